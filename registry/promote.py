"""``--promote ALIAS``: move a registry alias to the evaluated version when its kNN top-1
beats the version holding the alias; a tie keeps the holder. Each version's score is kept,
unrounded (``repr`` of the float, which reads back exactly), as its tag ``knn_top1``; the
decision, with both numbers, is recorded either way as the tag ``promotion.<alias>`` on
the evaluated version (and returned for the report)."""

from __future__ import annotations

from typing import Any

SCORE_TAG = "knn_top1"  # model version tag: the evaluated kNN top-1, unrounded


def record_score(client: Any, name: str, version: str, score: float) -> None:
    """Keep ``score`` on ``name``/``version`` as its tag ``knn_top1``, unrounded."""
    client.set_model_version_tag(name, version, SCORE_TAG, repr(float(score)))


def promote(client: Any, name: str, version: str, alias: str, score: float) -> dict[str, Any]:
    """Set ``alias`` on ``name``/``version`` if ``score`` beats the holder's; returns the
    decision record."""
    record_score(client, name, version, score)
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except Exception:  # the alias is not set yet
        holder = None
    record: dict[str, Any] = {"alias": alias, "version": version, "score": score,
                              "holder": None, "holder_score": None}
    if holder is not None:
        record["holder"] = str(holder.version)
        record["holder_score"] = float(holder.tags.get(SCORE_TAG, "-inf"))
    if holder is None:
        record["promoted"], why = True, "alias was unset"
    elif record["holder"] == str(version):
        record["promoted"], why = True, "already holds the alias"
    else:
        record["promoted"] = score > record["holder_score"]
        relation = ">" if record["promoted"] else "<="
        why = f"{score!r} {relation} {record['holder_score']!r} of version {holder.version}"
    if record["promoted"]:
        client.set_registered_model_alias(name, alias, version)
    record["reason"] = why
    verdict = "promoted" if record["promoted"] else "not promoted"
    client.set_model_version_tag(name, version, f"promotion.{alias}", f"{verdict}: {why}")
    return record
