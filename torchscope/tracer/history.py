"""The run's history, kept by the dormant agent: every step's loss (and, with the watch, its
gradient norms), traced or not, so a UI that attaches late sees what happened before.

**Loss** is the root of the step's top-level ``backward()`` when that root holds one value
(``loss.backward()``, ``torch.autograd.backward(loss)``; a root of several values, or several
roots, give no loss). Under gradient accumulation (several ``backward()`` in one step) it is
the *last* micro-batch's root, not their sum or mean: it is the value a loop that prints
``loss.item()`` after its update shows. Under a loss scaler (``GradScaler``,
``scaler.scale(loss).backward()``) it is the loss *before* scaling, as the job computed it,
and the point also keeps the scale the step ran with and whether the scaler skipped its
update (``scaler_calls``); a step whose update the watch refused (``on_nan="skip"``) is marked
skipped too. A step with no such backward has no loss (None).

Cost, per step, on the training thread: a reference to the root taken in ``backward()`` (the
wrapper the step clock already installs; no extra hook) and, at the step boundary, one point.
No host sync per step: a value on the CPU is read directly; a value on an accelerator is
detached and kept, and every ``batch`` steps (or at the next boundary after a UI asks, or
after a heartbeat) the kept values are stacked on their device and copied to pinned host
memory with ``non_blocking=True``, behind a CUDA event; a later boundary reads them once the
event says the copy is done (``Event.query()``: never waits). A device without events (MPS,
XLA) is read at the batch, one sync per ``batch`` steps. Values are therefore a batch late on
CUDA; the ``history`` command says how many are still on the device (``pending``).

With the watch on, the global gradient norm and each module's (``watch/norms.py``) come from
the watch's check, inside its one host read per step.

Memory: the :class:`~torchscope.protocol.history.RunHistory`'s bound (full resolution for the
newest ``keep`` steps, older ones folded into min/max/last buckets; module norms for the
newest ``module_keep`` steps) plus at most two batches of one-value device tensors.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from torchscope.protocol.history import ModuleValues, RunHistory, StepPoint
from torchscope.tracer import backward_calls, scaler_calls
from torchscope.tracer.errors import ReportOnce

_DisableTorchDispatch = torch._C._DisableTorchDispatch


# A value of a point still on its device: (index into the waiting points, field, 0-d tensor).
_DeviceValue = tuple[int, str, torch.Tensor]


_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


class _Copy:
    """One batch of device values on its way to the host."""

    __slots__ = ("events", "parts", "points")

    def __init__(
        self, points: list[StepPoint], parts: list[tuple[list[tuple[int, str]], Any]], events: list
    ):
        self.points = points  # the points waiting for these values, oldest first
        # ((index into points, field) per value, host or device tensor of those values)
        self.parts = parts
        self.events = events  # CUDA events recorded after the copies

    def ready(self) -> bool:
        return all(e.query() for e in self.events)

    def deliver(self) -> list[StepPoint]:
        for where, values in self.parts:
            for (i, name), v in zip(where, values.tolist(), strict=True):
                setattr(self.points[i], name, float(v))
        return self.points


class HistoryCollector:
    """The agent's history: a ``backward_calls`` listener for the loss and ``step_ends`` at
    every step boundary, on the training thread. The control thread reads it (``wire``,
    ``latest``) under its lock.

    owner: ``f() -> thread id`` of the training thread (the step clock's owner).
    batch: device values read to the host every this many steps.
    """

    needs_arguments = False  # backward_calls: the roots alone (its ``tensors``)
    host_devices: tuple[str, ...] = ("cpu",)  # read at once; others in batches (tests: none)

    def __init__(
        self,
        owner: Any,
        *,
        keep: int = 100_000,
        bucket: int = 100,
        module_keep: int = 10_000,
        batch: int = 32,
    ) -> None:
        self.history = RunHistory(keep, bucket, module_keep)
        self.batch = max(1, int(batch))
        self.lock = threading.Lock()
        self._owner = owner
        self._root: torch.Tensor | None = None  # the current step's last backward root
        # The last ``scaler.scale(loss)``: (scaled, loss, scaler), until its backward() begins.
        self._scaled: tuple[Any, torch.Tensor, Any] | None = None
        self._scaler: Any = None  # the loss scaler of the current step's root
        self._grad_norm: float | None = None  # the watch's, for the current step
        self._module_norms: ModuleValues | None = None
        self._open: int | None = None  # the step being gathered
        self.traced_now = False  # whether the step being gathered is traced (set at arming)
        self._waiting: list[StepPoint] = []  # closed, some value still on a device
        self._tensors: list[_DeviceValue] = []  # ... and those values
        self._copy: _Copy | None = None
        self._unsent: list[StepPoint] = []  # added since the last live event
        self._last_sent = time.monotonic()
        self.flush_soon = False  # a UI asked, or a heartbeat passed: copy what is waiting
        self.eager = False  # a condition waits on the values: copy every step
        self.sending = False  # a UI reads the stream or a file records: keep points for events
        self._error = ReportOnce("the run's history", "the job continues")

    # -- backward() (backward_calls listener, training thread) --------------------------------
    def backward_begins(self, kwargs: dict[str, Any]) -> None:
        if threading.get_ident() != self._owner():
            return None
        roots = kwargs.get("tensors")
        if type(roots) is not torch.Tensor:  # the loss itself, nearly always: no more to ask
            if isinstance(roots, (tuple, list)):
                roots = roots[0] if len(roots) == 1 else None
            if not isinstance(roots, torch.Tensor):
                roots = None
        self._scaler = None
        if self._scaled is not None:
            scaled, self._scaled = self._scaled, None
            if roots is scaled[0]:
                _, roots, self._scaler = scaled  # the loss before the scaler scaled it
        # No torch call here (a traced step's mode would see it): checked at the boundary.
        self._root = roots
        return None

    def backward_ends(self, ok: bool) -> None:
        if not ok and threading.get_ident() == self._owner():
            self._root = None

    # -- the loss scaler (scaler_calls listener, training thread) ------------------------------
    def loss_scaled(self, scaler: Any, outputs: Any, scaled: Any) -> None:
        if threading.get_ident() == self._owner() and isinstance(outputs, torch.Tensor):
            self._scaled = (scaled, outputs, scaler)

    def listen(self) -> _Listenings:
        """Listen to ``backward()`` and loss scaler calls; ``remove()`` the handle to stop."""
        return _Listenings(backward_calls.listen(self), scaler_calls.listen(self))

    # -- the watch (training thread, in its check) ---------------------------------------------
    def watch_norms(self, step: int, grad_norm: float, modules: ModuleValues | None) -> None:
        """The watch checked the current step (again, under LBFGS: the last check wins)."""
        self._grad_norm = grad_norm
        self._module_norms = modules

    # -- step boundaries (training thread) -----------------------------------------------------
    def step_ends(self, new: int, *, skipped: bool = False, spike: bool = False) -> list[StepPoint]:
        """Step ``new`` begins: the step before it gets its point (``skipped``: a loss scaler
        skipped its update). Returns the points that reached the history now (this one, or
        a batch whose values arrived)."""
        # Every step of a dormant job passes here: its checks are inline (a call costs about
        # a thousand instructions, each step).
        try:
            opened, self._open = self._open, new
            if opened is None:  # the first boundary: the step that begins now is the first
                return []
            if new > opened + 1:
                return []  # numbered anew (torchscope.step(n)): the same step goes on
            closing = new - 1
            root, self._root = self._root, None
            scaler, self._scaler = self._scaler, None
            point = StepPoint(
                closing,
                grad_norm=self._grad_norm,
                module_norms=self._module_norms,
                traced=self.traced_now,
                skipped=skipped,
                spike=spike,
            )
            self._grad_norm = self._module_norms = None
            on_device: list[tuple[str, torch.Tensor]] = []
            if root is None and scaler is None:
                pass  # no backward in the step: nothing to read
            elif (root is None or type(root) is torch.Tensor) and not (
                # A torch-function or dispatch mode on the stack (a traced step's, the job's
                # own): reading a value then needs them switched off (two cheap calls, where
                # switching them off and on costs more than the read on a small step).
                _function_modes() or _dispatch_modes()
            ):
                self._read_values(point, root, scaler, on_device)  # the common case
            else:
                # Outside any mode (a traced step's would record these) and any subclass's
                # handler; nothing here makes a graph (values are read or detached), so no
                # grad-mode switch either.
                with torch._C.DisableTorchFunction(), _DisableTorchDispatch():
                    self._read_values(point, root, scaler, on_device)
            added: list[StepPoint] = []
            with self.lock:
                if closing < opened:
                    # Renumbered back (micro-batches counted as steps before the first
                    # optimizer step were one step): what was said of them goes.
                    self._forget_from(closing)
                if on_device or self._waiting:
                    i = len(self._waiting)
                    self._waiting.append(point)
                    self._tensors.extend((i, name, t) for name, t in on_device)
                else:
                    self._add(point, added)
                if self._copy is not None:
                    self._take_copy(added, wait=False)
                due = len(self._waiting) >= self.batch or self.flush_soon or self.eager
                if self._waiting and self._copy is None and due:
                    self.flush_soon = False
                    self._start_copy(added)
            return added
        except Exception as exc:
            self._error("at a step boundary", exc)
            self._root = None
            return []

    def _read_values(
        self, point: StepPoint, root: torch.Tensor | None, scaler: Any, on_device: list
    ) -> None:
        """The step's loss and scale: host values read now, device values kept for a copy."""
        if root is not None and root.numel() == 1 and root.dtype.is_floating_point:
            if root.device.type in self.host_devices:
                point.loss = root.item()  # one call: no detach or reshape to make first
            else:
                on_device.append(("loss", root.detach().reshape(())))
        scale = scaler_calls.scale_of(scaler) if scaler is not None else None
        if scale is not None:
            # A copy: the scaler's update() changes its scale in place after this.
            value = scale.reshape(())
            if value.device.type not in self.host_devices:
                value = value.clone()
            self._read(point, "scale", value, on_device)

    def _read(self, point: StepPoint, name: str, value: torch.Tensor, on_device: list) -> None:
        """A host value at once; a device value later, in the next batch's copy."""
        if value.device.type in self.host_devices:
            setattr(point, name, value.item())
        else:
            on_device.append((name, value))

    def _add(self, point: StepPoint, added: list[StepPoint]) -> None:
        self.history.add(point)
        added.append(point)
        self._unsent.append(point)
        if not self.sending and len(self._unsent) > self.batch:
            # Nobody reads the stream: only the newest few wait for one who will.
            del self._unsent[0]

    def _forget_from(self, step: int) -> None:
        self.history.discard_from(step)
        keep = [i for i, p in enumerate(self._waiting) if p.step < step]
        self._waiting = [self._waiting[i] for i in keep]
        kept = set(keep)  # the points kept are the oldest: their indices stay
        self._tensors = [v for v in self._tensors if v[0] in kept]
        self._unsent = [p for p in self._unsent if p.step < step]

    def _take_copy(self, added: list[StepPoint], *, wait: bool) -> None:
        """The copy in flight, delivered once it has landed (``wait``: waiting for it, at the
        job's end only; called with the lock held)."""
        copy = self._copy
        if copy is None or not (wait or copy.ready()):
            return
        if wait:
            for e in copy.events:
                e.synchronize()
        self._copy = None
        for p in copy.deliver():
            self._add(p, added)

    def _start_copy(self, added: list[StepPoint]) -> None:
        """Stack the waiting device values per device and start their copies to the host
        (called with the lock held; no host sync on CUDA)."""
        points, tensors = self._waiting, self._tensors
        self._waiting, self._tensors = [], []
        groups: dict[tuple[torch.device, torch.dtype], list[_DeviceValue]] = {}
        for v in tensors:
            groups.setdefault((v[2].device, v[2].dtype), []).append(v)
        parts, events = [], []
        with torch._C.DisableTorchFunction(), _DisableTorchDispatch(), torch.no_grad():
            for (device, _), values in groups.items():
                stacked = torch.stack([t for _, _, t in values])
                if device.type == "cuda":
                    host = stacked.to("cpu", non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
                    events.append(event)
                else:
                    host = stacked.cpu()  # no events to wait on: one sync per batch
                parts.append(([(i, name) for i, name, _ in values], host))
        copy = _Copy(points, parts, events)
        if copy.ready():  # nothing in flight (or no device that could be)
            for p in copy.deliver():
                self._add(p, added)
        else:
            self._copy = copy

    def finish(self) -> list[StepPoint]:
        """The job ends: the values still on their way or waiting are read (may wait)."""
        added: list[StepPoint] = []
        try:
            with self.lock:
                self._take_copy(added, wait=True)
                if self._waiting:
                    self._start_copy(added)
                    self._take_copy(added, wait=True)
        except Exception as exc:
            self._error("at the job's end", exc)
        return added

    def drop(self) -> None:
        """In a forked child: nothing of the parent's device values is kept."""
        self._root = None
        self._waiting, self._tensors, self._copy = [], [], None

    # -- readers -------------------------------------------------------------------------------
    def take_unsent(self, *, every: float = 1.0) -> list[StepPoint]:
        """The points for a live ``history`` event, when there are a batch of them or
        ``every`` seconds have passed since the last one (training thread)."""
        if not self._unsent or not self.sending:
            return []
        now = time.monotonic()
        if len(self._unsent) < self.batch and now - self._last_sent < every:
            return []
        with self.lock:
            points, self._unsent = self._unsent, []
        self._last_sent = now
        return points

    def pending(self) -> int:
        """Steps closed whose loss is still on a device."""
        copy = self._copy
        return len(self._waiting) + (len(copy.points) if copy is not None else 0)

    def wire(self, since: int | None = None, max_points: int | None = None) -> dict[str, Any]:
        """The history as plain data (the ``history`` command's reply), from any thread:
        every point and bucket, or the points after ``since`` (no buckets), at most
        ``max_points`` of the newest (0: none, just ``latest``)."""
        with self.lock:  # references only: the training thread waits for no encoding
            h = self.history
            if max_points == 0:
                points: list[StepPoint] = []
            elif since is not None:
                points = list(h.since(since))
            else:
                points = list(h.points)
            buckets = [b.to_wire() for b in h.buckets] if since is None else []
            latest = h.latest()
        if max_points is not None and len(points) > max_points:
            points = points[len(points) - max_points :]
        return {
            "points": [p.to_wire() for p in points],
            "buckets": buckets,
            "latest": latest.to_wire() if latest is not None else None,
            "pending": self.pending(),
        }


class _Listenings:
    """The collector's listener handles, removed together."""

    def __init__(self, *handles: Any) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
