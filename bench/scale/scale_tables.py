"""The scale benchmark's records (``python -m bench.scale --part ... --record NAME``, kept as
``scale/NAME``) as ``docs/benchmarks.md`` shows them: the ingestion costs fitted against
the size, the training stream at CC12M, remote lists and resumes, and evaluation at
ImageNet's cardinality. A view shows the parts its record holds."""

from __future__ import annotations

from typing import Any

from bench.records import source_line
from bench.scale.fit import exponent

STAGE_NAMES = {"knn": "kNN (faiss flat, k <= 200)", "margin": "SINCERE margin",
               "probe": "linear probe, 1 epoch", "diagnostics": "diagnostics (on 10,000 queries)"}


def count(n: int) -> str:
    """100000 -> 100k, 1281167 -> 1.28M."""
    if n >= 1_000_000:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e3:.3g}k" if n >= 1_000 else str(n)


def span(rows: list[dict[str, Any]], key: str) -> str:
    return f"{count(rows[0][key])}-{count(rows[-1][key])}"


def fitted(value: float) -> str:
    """An exponent to two places, never "-0.00"."""
    return f"{round(value, 2) + 0.0:.2f}"


def mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def row(stage: str, sizes: str, time_exponent: str, memory_exponent: str,
        largest: str) -> str:
    return f"| {stage} | {sizes} | {time_exponent} | {memory_exponent} | {largest} |"


def command_row(stage: str, part: dict[str, Any], size: str, unit: str, more: str = "") -> str:
    """A command fitted on its wall seconds and its parent's peak memory; ``more`` follows
    its cost at the largest size."""
    last, fit = part["rows"][-1], part["exponent"]
    return row(stage, f"{span(part['rows'], size)}{unit}", f"{fitted(fit['seconds'])}",
               f"{fitted(fit['command_rss_mib'])}",
               f"{last['seconds']:.0f} s, {mib(last['command_rss_mib'])}{more}")


def cost_rows(got: dict[str, Any]) -> list[str]:
    """A row per ingestion part the record holds: sizes, time and memory exponents, and the
    cost at the largest size."""
    rows = []
    if "captions" in got:
        rows.append(command_row("make-shards of a caption table (2 workers)", got["captions"],
                                "rows", " rows",
                                f"; CC12M ~{got['captions']['cc12m']['seconds'] / 60:.0f} min"))
    if "index" in got:
        two = [r for r in got["index"]["rows"] if r["workers"] == 2]
        workers = [r["worker_rss_mib"] for r in two]
        memory = (f"{fitted(exponent([r['tars'] for r in two], workers))}" if min(workers) > 0
                  else "-")  # a worker given no tar
        rows.append(row("indexing img2dataset tars in place (2 workers)",
                        f"{two[0]['tars']}-{two[-1]['tars']} tars",
                        f"{fitted(got['index']['exponent'])}",
                        f"{memory} a worker ({mib(workers[-1])})",
                        f"{two[-1]['seconds']:.1f} s; CC12M's 1,200 tars "
                        f"~{got['index']['cc12m_seconds'] / 60:.0f} min"))
    if "tree" in got:
        rows.append(command_row("make-shards of a class-sorted tree (2 workers)", got["tree"],
                                "images", " images"))
    if "graph" in got:
        last, fit = got["graph"]["rows"][-1], got["graph"]["exponent"]
        sizes = f"{span(got['graph']['rows'], 'rows')} captions"
        rows.append(row("graph-precompute collect (part 0) / merge", sizes,
                        f"- / {fitted(fit['merge_s'])}",
                        f"{fitted(fit['collect_rss_mib'])} / {fitted(fit['merge_rss_mib'])}",
                        f"merge {last['merge_s']:.1f} s, {mib(last['merge_rss_mib'])}"))
        rows.append(row("the merge centred (`graph.center`)", sizes,
                        fitted(fit["merge_center_s"]), fitted(fit["merge_center_rss_mib"]),
                        f"{last['merge_center_s']:.1f} s, "
                        f"{mib(last['merge_center_rss_mib'])}"))
    if "neighbours" in got:
        scratch = [r for r in got["neighbours"]["rows"] if r["where"] == "scratch"]
        fit = got["neighbours"]["exponent"]
        rows.append(row("caption-neighbour graph (scratch files)", span(scratch, "rows"),
                        f"{fitted(fit['seconds'])}",
                        f"{fitted(fit['rss_mib'])} (anonymous **{fitted(fit['anon_mib'])}**)",
                        f"{scratch[-1]['seconds']:.1f} s, recall {scratch[-1]['recall']:.4f}"))
    if "ledger" in got:
        rows.append(command_row("ledger tool over 2 ranks' epoch", got["ledger"], "samples", ""))
    return rows


def render_costs(record: dict[str, Any]) -> list[str]:
    return [source_line(record), "",
            "| stage | sizes | time exponent | memory exponent | at the largest size |",
            "| --- | --- | --- | --- | --- |", *cost_rows(record["figures"])]


def render_stream(record: dict[str, Any]) -> list[str]:
    """The epoch plan's coverage of CC12M at each world, and batch class mixing."""
    epochs = record["figures"]["epochs"]
    lines = [f"{source_line(record)} CC12M's 12M samples in 1,200 shards, a chunk of "
             f"{epochs['coverage'][0]['batch']} samples a rank, every chunk slot's order "
             "enumerated through the epoch plan:", "",
             "| world (ranks) | delivered | twice | left (< 1 global batch) | "
             "seconds, whole world | ms per rank |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['world'].split('x')[0]} | {r['delivered']:,} | {r['twice']:,} | "
              f"{r['left']:,} | "
              f"{r['seconds']:.1f} | {r['ms_per_rank']:.0f} |" for r in epochs["coverage"]]
    mixing = {kind: [r for r in epochs["mixing"] if r["shards"] == kind]
              for kind in ("shuffled", "class-sorted")}
    shuffled, sorted_ = mixing["shuffled"], mixing["class-sorted"]

    def spread(rows: list[dict[str, Any]]) -> str:
        low, high = (f(r["distinct_classes"] for r in rows) for f in (min, max))
        return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"

    lines += ["", f"Batches from shards make-shards writes hold as many classes as i.i.d. "
              f"sampling at every world (ImageNet's shape listed class by class, "
              f"{spread(shuffled)} distinct classes a chunk of {shuffled[0]['batch']} against "
              f"{shuffled[0]['iid']:.1f} i.i.d.); class-sorted shards (`shards.shuffle=false`) "
              f"give {spread(sorted_)}."]
    return lines


def render_remote(record: dict[str, Any]) -> list[str]:
    """Requests a remote list without a manifest costs, and a resume's cost by position."""
    got = record["figures"]
    counts = got["counts"]["rows"][-1]
    ratios = got["resume"]["ratio_90_to_10"]
    return [f"{source_line(record)} A remote shard list without a manifest costs one request "
            f"per shard at the first open and one at every later open ({counts['shards']:,} "
            f"shards: {counts['first_open_requests']:,} requests, "
            f"{counts['first_open_s']:.1f} s, then {counts['later_open_requests']} request, "
            f"{counts['later_open_s'] * 1e3:.0f} ms). Resuming a loader at 90% of an epoch "
            f"costs {ratios['local']:.2f}x (local) and {ratios['http']:.2f}x (HTTP) of resuming "
            "at 10% (the time to the first batch, median of 3)."]


def render_evaluation(record: dict[str, Any]) -> list[str]:
    part = record["figures"]["evaluation"]
    stages = [stage for stage in STAGE_NAMES if stage in part["exponent"]]
    sizes = sorted({r["rows"] for r in part["rows"]})
    at = {(r["stage"], r["rows"]): r for r in part["rows"]}
    lines = [source_line(record), "",
             f"| stage | bank {sizes[0]:,} | {sizes[-1]:,} | time exponent | added memory, "
             "smallest / largest | memory exponent |", "| --- | --- | --- | --- | --- | --- |"]
    for stage in stages:
        small, large = at[stage, sizes[0]], at[stage, sizes[-1]]
        fit = part["exponent"][stage]
        lines.append(f"| {STAGE_NAMES[stage]} | {small['seconds']:.1f} s | "
                     f"{large['seconds']:.1f} s | {fitted(fit['seconds'])} | "
                     f"{mib(small['stage_added_mib'])} / {mib(large['stage_added_mib'])} | "
                     f"{fitted(fit['stage_added_mib'])} |")
    return lines


VIEWS = {"costs": render_costs, "stream": render_stream, "remote": render_remote,
         "evaluation": render_evaluation}
