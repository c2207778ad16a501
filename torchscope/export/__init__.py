"""Take a recording elsewhere: ``torchscope export F --format perfetto|csv|parquet -o OUT``.

- ``perfetto``: Chrome/Perfetto trace-event JSON (``torchscope.export.perfetto``);
- ``csv``/``parquet``: one row per event of ``--kind`` (``torchscope.export.tables``; pandas,
  and pyarrow for Parquet, are optional extras).

Nothing here imports torch, and pandas only when a table is asked for.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from torchscope.export.tables import TABLE_KINDS, TableError, read_table, to_pandas, write_table
from torchscope.protocol.output import replacing, same_file

__all__ = ["TABLE_KINDS", "TableError", "main", "read_table", "to_pandas", "write_table"]


def _fail(message: str) -> int:
    print(f"torchscope: error: {message}", file=sys.stderr)
    return 2


def main(args: Any) -> int:
    """``torchscope export``: 0 written, 2 bad input (one line on stderr)."""
    from torchscope.protocol.codec import ProtocolError
    from torchscope.protocol.tracefile import TraceReader

    fmt, out = args.format, args.output
    if fmt == "perfetto" and args.kind is not None:
        return _fail("--kind picks the rows of a table: it goes with --format csv or parquet")
    if args.kind is None:
        args.kind = "op"
    if fmt != "perfetto" and args.kind not in TABLE_KINDS:
        return _fail(f"--kind must be one of {', '.join(TABLE_KINDS)}, not {args.kind!r}")
    if fmt != "perfetto":
        try:  # before reading anything: a missing extra is one line, at once
            from torchscope.export.tables import _pandas

            _pandas()
            if fmt == "parquet":
                try:
                    import pyarrow  # noqa: F401
                except ImportError:
                    from torchscope.export.tables import MISSING_PYARROW, MissingExtra

                    raise MissingExtra(MISSING_PYARROW) from None
        except TableError as exc:
            return _fail(str(exc))
    if out != "-" and same_file(out, args.file):
        return _fail(f"-o {out} is the recording being exported: give another path")
    try:
        with TraceReader(args.file) as reader:
            if fmt == "perfetto":
                from torchscope.export.perfetto import write

                meta = {"source": os.path.basename(args.file)}
                if out == "-":
                    n = write(reader.iter_events(), sys.stdout, meta)
                else:
                    with replacing(out) as f:
                        n = write(reader.iter_events(), f, meta)
                what = f"{n} trace events"
            else:
                df = to_pandas(reader.iter_events(), args.kind)
                if out == "-" and fmt == "csv":
                    write_table(df, sys.stdout, fmt)
                else:
                    with replacing(out, "wb") as f:
                        write_table(df, f, fmt)
                what = f"{len(df)} rows of kind {args.kind}"
            if reader.truncated:
                print(
                    f"torchscope: {args.file} was cut short at byte {reader.truncated_at}; "
                    "exported the events before it",
                    file=sys.stderr,
                )
    except (ProtocolError, TableError) as exc:
        return _fail(f"{args.file}: {exc}" if isinstance(exc, ProtocolError) else str(exc))
    except OSError as exc:
        return _fail(f"cannot write {out}: {exc.strerror or exc}")
    if out != "-":
        print(f"torchscope: wrote {what} to {out}", file=sys.stderr)
    return 0
