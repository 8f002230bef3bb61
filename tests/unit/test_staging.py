"""checkpoint/staging.py: how a GPU state leaves the GPUs for a hand-over (its staged write on CPU tensors is
tested in tests/distributed/test_handover_memory.py)."""

from __future__ import annotations


def test_a_state_that_cannot_be_staged_is_written_from_the_gpu(monkeypatch):
    """Pinned host memory refused (a container's memlock limit): the rank writes as before and says so."""
    import torch

    from elastic_trainer.checkpoint import staging

    state, said = {"w": torch.ones(2)}, []

    def refuse(state, pin=True):
        raise torch.cuda.OutOfMemoryError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(staging, "is_on_gpu", lambda state: True)
    monkeypatch.setattr(staging, "to_host", refuse)
    got, threads = staging.for_writing(state, 8, say=lambda line, flush: said.append(line))
    assert got is state and threads == 1
    assert said == [
        "[checkpoint] the state could not be staged in pinned host memory (CUDA error: out of memory); "
        "writing it from the GPU, more slowly"
    ]
    monkeypatch.setattr(staging, "is_on_gpu", lambda state: False)
    assert staging.for_writing(state, 8) == (state, 1)


def test_writer_threads_share_the_hosts_cores(monkeypatch):
    from elastic_trainer.checkpoint import staging

    monkeypatch.setattr(staging.os, "cpu_count", lambda: 16)
    assert [staging.writer_threads(n) for n in (1, 2, 8, 32)] == [8, 8, 2, 1]
