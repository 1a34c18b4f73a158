"""The loader's state: its format, and the states of all data-parallel ranks merged into one of the global
row sequence."""

from __future__ import annotations

from data_pipeline import DataError

STATE_FORMAT = 2  # format 1 (before streams): per-reader positions, resumable on the same layout only


def merged_ranges(ranges) -> list[tuple[int, int]]:
    """Row ranges [start, stop) sorted, the overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif stop > start:
            out.append((start, stop))
    return out


def check_format(state: dict) -> None:
    if state.get("format") != STATE_FORMAT:
        raise DataError(
            "the data-loader state was written by an older version (per-reader positions, before "
            "data.streams); it cannot be resumed exactly: start a new run from its weights with "
            "init_from="
        )


def check_counts(streams: dict[int, dict], rank: int, dp_size: int, rows: int, n_streams: int) -> None:
    """After ``rows`` local rows of rank ``rank`` of ``dp_size`` (global rows rank + dp_size * i), every stream
    has made one sample per such row that falls on it."""
    period = n_streams // dp_size  # a rank's rows visit its streams in turn
    for k in range(rank, n_streams, dp_size):
        first = (k - rank) // dp_size  # the rank's first local row on stream k
        expected = max(0, -(-(rows - first) // period))
        made = streams.get(k, {"samples": 0})["samples"]
        if made != expected:
            raise DataError(
                f"the data-loader state is inconsistent: stream {k} made {made} samples, {expected} "
                f"expected after {rows} rows of rank {rank} of {dp_size} (states of ranks from "
                "different steps?)"
            )


def merge_states(states: list[dict]) -> dict:
    """The states of all data-parallel ranks of one run (tensor-parallel peers may repeat) as one state of the
    global row sequence, which ``load_state_dict`` accepts on any layout."""
    if not states:
        raise DataError("merge_states needs the data-loader states of all data-parallel ranks, got none")
    for state in states:
        check_format(state)
    first = states[0]
    by_rank = {s["dp_rank"]: s for s in states}
    if sorted(by_rank) != list(range(first["dp_size"])):
        raise DataError(
            f"merge_states needs the states of data-parallel ranks 0..{first['dp_size'] - 1}, got "
            f"ranks {sorted(by_rank)}"
        )
    for s in states:
        same = (s["streams"], s["dp_size"], s["sources"]) == (first["streams"], first["dp_size"], first["sources"])
        if not same or s["rows"] != first["rows"]:
            raise DataError(
                "the data-loader states of the ranks do not belong together (other streams, layout, "
                "datasets or rows consumed)"
            )
    streams = {k: v for s in by_rank.values() for k, v in s["stream_states"].items()}
    skipped = sorted({p for s in states for p in s["skipped"]})
    skip_rows = merged_ranges(tuple(r) for s in states for r in s.get("skip_rows", []))
    return {
        "format": STATE_FORMAT,
        "streams": first["streams"],
        "dp_rank": 0,
        "dp_size": 1,
        "rows": first["rows"] * first["dp_size"],
        "stream_states": streams,
        "skipped": skipped,
        "sources": first["sources"],
        "skip_rows": [list(r) for r in skip_rows],
    }
