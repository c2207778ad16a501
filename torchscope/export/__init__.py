"""Take a recording elsewhere (what ``torchscope export F --format perfetto|csv|parquet``
writes):

- ``perfetto``: Chrome/Perfetto trace-event JSON (``torchscope.export.perfetto``);
- ``csv``/``parquet``: one row per event of a kind (``torchscope.export.tables``; pandas,
  and pyarrow for Parquet, are optional extras).

Nothing here imports torch, and pandas only when a table is asked for.
"""

from __future__ import annotations

from torchscope.export.tables import TABLE_KINDS, TableError, read_table, to_pandas, write_table

__all__ = ["TABLE_KINDS", "TableError", "read_table", "to_pandas", "write_table"]
