"""The counter of host waits (tests/host_waits.py) itself, on CPU: stand-in events and streams,
CPU tensors that count as on a device, and what lies outside its scope."""

from __future__ import annotations

import torch

from host_waits import recording

HERE = __file__


class Event:
    """A stand-in CUDA event: its query passes on the third call."""

    def __init__(self):
        self.queries = 0

    def record(self, stream=None):
        pass

    def query(self):
        self.queries += 1
        return self.queries >= 3

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


class Stream:
    def synchronize(self):
        pass

    def wait_event(self, event):
        pass


def _outside_scope(x: torch.Tensor) -> float:
    return x.sum().item()


def test_every_kind_is_recorded_under_its_mark(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    x = torch.arange(4.0)
    with recording(scope=HERE, is_device=lambda t: t.numel() == 4, cupy=False) as rec:
        rec.mark("a")
        e = torch.cuda.Event()
        while not e.query():  # a poll: one wait, however many queries
            pass
        torch.cuda.Event().synchronize()
        e.wait(Stream())                  # the stream waits, not the host
        Stream().wait_event(e)
        Stream().synchronize()
        torch.cuda.synchronize()
        rec.mark("b")
        x.cpu(), x.tolist(), x.to("cpu"), x.to(device="cpu")
        x.to(torch.float64)               # no device named: not a copy to the host
        x.to("cpu", non_blocking=True)    # the host does not wait
        torch.empty(4).copy_(x)
        torch.empty(4).copy_(x, non_blocking=True)
        torch.empty(3).copy_(x[:3])       # not a device tensor by this rule
    assert rec.host_waits("a") == 4, rec.table("a")  # poll, event.synchronize, stream and device synchronize
    assert [w.kind for w in rec.waits if w.label == "a"].count("event.poll") == 3
    assert [w.kind for w in rec.waits if w.label == "a"].count("device_wait") == 2
    kinds_b = [(w.kind, w.what) for w in rec.waits if w.label == "b"]
    assert kinds_b == [("host_copy", "Tensor.cpu"), ("host_copy", "Tensor.tolist"), ("host_copy", "Tensor.to"),
                       ("host_copy", "Tensor.to"), ("host_copy", "Tensor.copy_")], kinds_b
    assert all(w.where.startswith("test_host_waits.py:") for w in rec.waits)
    assert rec.host_waits() == 9


def test_only_calls_from_inside_the_scope_count_and_everything_is_restored(monkeypatch):
    originals = (torch.cuda.Event.synchronize, torch.cuda.Event.query, torch.cuda.Stream.synchronize,
                 torch.cuda.synchronize, torch.Tensor.item, torch.Tensor.to, torch.Tensor.copy_)
    x = torch.ones(4)
    with recording(scope="/nonexistent/package", is_device=lambda t: True) as rec:
        x[0].item(), x.cpu(), torch.empty(4).copy_(x)
        assert torch.Tensor.item is not originals[4]
    assert rec.waits == [] and "torch.cuda.Event.synchronize" in rec.patched and "Tensor.item" in rec.patched
    assert (torch.cuda.Event.synchronize, torch.cuda.Event.query, torch.cuda.Stream.synchronize,
            torch.cuda.synchronize, torch.Tensor.item, torch.Tensor.to, torch.Tensor.copy_) == originals
    assert "item" not in torch.Tensor.__dict__ or torch.Tensor.__dict__["item"] is originals[4]


def test_zipccl_reads_on_a_device_are_seen_through_torch(monkeypatch):
    """A read by zipccl (zipccl.reference.packet.to_host of a tensor the rule puts on a device)
    counts, at zipccl's line; the test's own read of the same tensor does not."""
    from zipccl.reference.packet import to_host
    x = torch.arange(8, dtype=torch.uint8)
    with recording(is_device=lambda t: t.numel() == 8) as rec:
        to_host(x)
        _outside_scope(x.float())
        x.tolist()
    assert rec.host_waits() == 1 and rec.waits[0].what == "Tensor.cpu", rec.table()
    assert rec.waits[0].where.startswith("packet.py:")
