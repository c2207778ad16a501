"""``torchscope demo``: the UI on a simulated training job, no torch needed (a synthetic trace,
and a fake job that pauses, steps and answers commands as a real one does)."""
