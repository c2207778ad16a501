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

import dataclasses
from typing import TYPE_CHECKING, Any

from torchscope.tracer.options import Options

if TYPE_CHECKING:
    from torchscope.tracer.agent import Agent


class ServedJob:
    """The job a callback serves: started once, renumbered when the framework's count differs."""

    def __init__(self, keywords: dict[str, Any], owner: str = "TorchscopeCallback") -> None:
        # Checked when the callback is built, not minutes later when training starts.
        self.options = Options.for_serve(f"{owner}()", "it takes torchscope.serve()'s", **keywords)
        self.given = tuple(keywords)  # a job served already takes only these

    def start(self, global_step: int) -> Agent:
        """Serve this job, numbering the current step ``global_step``. A job served already
        (``torchscope run``, the script's own ``serve()``) takes the options this callback was
        given where it can, and says which it cannot."""
        from torchscope.tracer import api, job_end
        from torchscope.tracer.agent import current_agent
        from torchscope.tracer.served_again import serve_again

        running = current_agent()
        if running is None:
            # A copy: the agent keeps (and completes) the options it starts with.
            agent = api.serve(dataclasses.replace(self.options))
        else:
            job_end.install()
            serve_again(running, self.options, only=self.given)
            agent = running
        self.follow(global_step)
        return agent

    def follow(self, global_step: int) -> None:
        """Number the current step ``global_step`` if the agent counts it otherwise."""
        from torchscope.tracer.agent import current_agent

        agent = current_agent()
        if agent is not None and agent.clock.step != global_step:
            agent.clock.set_step(global_step)
