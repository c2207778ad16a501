"""What torchscope tells about recordings, as a library: no argument parsing, printing or exit
codes (those are the commands', :mod:`torchscope.cli`).

- :mod:`~torchscope.analysis.trace`: a recording in memory (``Trace``, ``load_trace``), its
  alerts one per origin (``fold_alerts``), and a multi-rank job's origins across every rank's
  recording (``job_origins``);
- :mod:`~torchscope.analysis.align`: how two recordings' events line up;
- :mod:`~torchscope.analysis.diff`: where two recordings diverge, and the report;
- :mod:`~torchscope.analysis.render`: events as a text table for people (``dump``).

Imports neither torch nor textual: the UI and the file commands run without them.
"""
