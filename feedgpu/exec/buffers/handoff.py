"""Handing batches to the training loop on a CUDA device, shared by the Python engine's device
prefetch (:class:`~feedgpu.prefetch.CudaPrefetcher`) and the DALI engine
(:class:`~feedgpu.exec.dali.engine.DaliWork`).

Copies to the device run on a side stream (:class:`SideStream`), so they overlap the training
step; an event recorded after them is what the training loop's stream waits on before it uses
the batch (:func:`hand_over`), and ``record_stream`` keeps the caching allocator from giving the
memory to another tensor while that stream may still read it. The host memory copied from is
recycled by :class:`~feedgpu.exec.buffers.host.HostBuffers`. Only used where CUDA is available.
"""
from __future__ import annotations

__all__ = ["SideStream", "hand_over"]


class SideStream:
    """A CUDA stream on ``device`` (``"cuda"``, ``"cuda:N"`` or a ``torch.device``) for copies to
    it: run the copies inside :meth:`use`, then :meth:`record` the event that marks them done."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def use(self):
        """Context manager: CUDA work queued inside it goes to the side stream."""
        return self.torch.cuda.stream(self.stream)

    def record(self):
        """A ``torch.cuda.Event`` recorded on the side stream after the work queued so far."""
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev


def hand_over(event, *tensors) -> None:
    """Give ``tensors`` (on one CUDA device, produced on a side stream before ``event``) to the
    device's current stream: it waits for ``event`` before its next work, and each tensor is
    marked as used by it (``record_stream``)."""
    import torch

    cur = torch.cuda.current_stream(tensors[0].device)
    cur.wait_event(event)
    for t in tensors:
        t.record_stream(cur)
