"""The table of ``graph-precompute`` tasks (``graph.task``): each entry runs its task from
``graph.*`` and returns the line the command prints, and declares the keys it cannot run
without. Adding a task is its function, an entry here, its test and a line in
``docs/graph.md``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.config import InvalidValue
from core.tables import table_entry
from data_pipeline.graph.class_graph import build_class_graph
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.job import run_captions


def needs(*keys: str) -> Callable[[GraphConfig], None]:
    """A check that each of ``keys`` (of graph.*) is set."""
    def check(cfg: GraphConfig) -> None:
        for key in keys:
            if not getattr(cfg, key):
                raise InvalidValue(key, f"task={cfg.task} needs graph.{key}")
    return check


def shards_or_class_names(cfg: GraphConfig) -> None:
    if not (cfg.shards or cfg.class_names):
        raise InvalidValue("shards", f"task={cfg.task} reads the class names of the shards' "
                                     "manifest; set graph.shards (or graph.class_names)")


@dataclass(frozen=True)
class GraphTaskSpec:
    """A task and what it needs."""

    run: Callable[[GraphConfig], str]  # does the task; the line to print ("": none)
    check: Callable[[GraphConfig], None] = needs()  # its graph.* keys, before any work


def captions(cfg: GraphConfig) -> str:
    """Every sample's caption embedded once; a rank that does not merge prints nothing."""
    store = run_captions(cfg)
    if store is None:
        return ""
    meta = store.meta
    return (f"graph-precompute: {meta['num_keys']} captions, {meta['num_unique']} distinct "
            f"({meta['duplicate_rate']:.1%} duplicates), {meta['truncated']} truncated, "
            f"skipped {meta['skipped'] or 'none'} -> {cfg.output}")


# the neighbour graph's module needs faiss: imported by its tasks, not by every stage that
# checks graph.* (a GPU node may have no faiss)
def neighbours(cfg: GraphConfig) -> str:
    from data_pipeline.graph.neighbours import build_neighbours

    graph = build_neighbours(cfg)
    return (f"graph-precompute: caption-neighbour graph ({graph.index}, recall "
            f"{graph.recall:.3f} against "
            f"exact search on a sample) -> {graph.path}")


def show(cfg: GraphConfig) -> str:
    from data_pipeline.graph.neighbours import describe

    return describe(cfg)


TASKS: dict[str, GraphTaskSpec] = {
    "captions": GraphTaskSpec(captions, needs("shards")),
    "class_graph": GraphTaskSpec(
        lambda cfg: f"graph-precompute: class graph -> {build_class_graph(cfg)}",
        shards_or_class_names),
    "neighbours": GraphTaskSpec(neighbours),
    "show": GraphTaskSpec(show, needs("key")),
}


def task_spec(name: str) -> GraphTaskSpec:
    """The entry of task ``name``; :class:`InvalidValue` for ``task`` naming the choices."""
    return table_entry(TASKS, name, "task", "task")


def check_task(cfg: GraphConfig) -> None:
    """``graph.*`` gives the configured task what its entry says it needs."""
    task_spec(cfg.task).check(cfg)
