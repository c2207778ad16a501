"""What runs while a job is armed (traced): the session (``session.Tracer``) and the recorders,
one per level — forward ops (``forward``, a TorchFunctionMode) and backward nodes
(``backward``, hooks on every ``grad_fn``) — with what they share: what a call is (``calls``),
the tensor summaries and their memo (``tensors``, ``summary``), the pipeline that delivers
events and checks them for NaN/Inf origins (``pipeline``, ``alerts``), pausing (``pausing``),
module paths (``modules``), source lines (``source``), collectives (``collectives``).

The aten level (a TorchDispatchMode) plugs in here as a third recorder beside these two.
"""
