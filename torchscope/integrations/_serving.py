"""What every framework callback does: serve the job, and number its steps as the framework does.

The agent already ends a step at every ``optimizer.step()``, which is what Lightning's
``trainer.global_step`` and the HF ``state.global_step`` count, so on a fresh run the numbers
agree by themselves and nothing is renumbered. They part when the framework's count does not
start at 0 (a run resumed from a checkpoint) or counts an update the optimizer never ran (an
fp16 step ``GradScaler`` skipped); then the callback renumbers with ``torchscope.step(n)``.
Only when they differ: ``step(n)`` is a step boundary, and a second boundary at the same step
would use up a step of a ``record --next N``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from torchscope.tracer.agent import Agent


class ServeKeywords(TypedDict, total=False):
    """``torchscope.serve()``'s keyword arguments, which every callback takes (a test keeps the
    two in step)."""

    steps: str | int | None
    record: str | os.PathLike | None
    break_on: str | list[str] | tuple[str, ...]
    wait: bool
    hold: bool
    lease: float
    values: int
    optimizer_ops: bool
    aten: bool | str | None
    eager_check: bool
    quiet: bool
    watch: str | None
    on_nan: str
    history: bool
    log: Any  # (spec, expression) logpoints: see serve()
    edit: Any  # (spec, expression) edits at every hit: see serve()


class ServedJob:
    """The job a callback serves: started once, renumbered when the framework's count differs."""

    def __init__(self, options: dict[str, Any], owner: str = "TorchscopeCallback") -> None:
        unknown = sorted(options.keys() - ServeKeywords.__annotations__.keys())
        if unknown:
            # Said when the callback is built, not minutes later when training starts.
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {unknown[0]!r} "
                "(it takes torchscope.serve()'s)"
            )
        self.options = dict(options)

    def start(self, global_step: int) -> Agent:
        """Serve this job, numbering the current step ``global_step``. A job served already
        (``torchscope run``, the script's own ``serve()``) takes the options this callback was
        given where it can, and says which it cannot."""
        import torchscope
        from torchscope.tracer.agent import current_agent

        running = current_agent()
        if running is None:
            agent = torchscope.serve(**self.options)
        else:
            from torchscope.tracer import job_end
            from torchscope.tracer.served_again import serve_again, serve_options

            job_end.install()
            serve_again(running, serve_options(**self.options), only=self.options)
            agent = running
        self.follow(global_step)
        return agent

    def follow(self, global_step: int) -> None:
        """Number the current step ``global_step`` if the agent counts it otherwise."""
        from torchscope.tracer.agent import current_agent

        agent = current_agent()
        if agent is not None and agent.clock.step != global_step:
            import torchscope

            torchscope.step(global_step)
