"""vLLM's KV offloading connector on the CPU build, for the end-to-end tests.

vLLM's offloading connector (``vllm/distributed/kv_transfer/kv_connector/v1/
offloading_connector.py``) moves KV with a worker that runs only on CUDA-alike and XPU
platforms and reads KV caches with the block on the first dimension; the CPU build's
caches have it second. Its scheduler side (the offload manager with its LRU
evictions, the store and load jobs) runs anywhere. :class:`HostCopyOffloadingConnector`
is that connector, whole on the scheduler side, with a worker that moves KV pages by
plain tensor copies between the engine's KV caches and a host buffer, synchronously:
a store or load is done when it is submitted, and reported finished at the next
``get_finished``.

Loaded as an out-of-tree connector: :func:`offload_config`.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult


class HostCopyWorker(OffloadingWorker):
    """Copies KV pages between the KV cache tensors (one per layer, indexed by block
    id on their first dimension) and a host copy of them per chunk block."""

    def __init__(self, tensors, blocks_per_chunk: int, num_chunks: int) -> None:
        self.tensors = list(tensors)
        self.per = blocks_per_chunk
        self.host = [torch.zeros((num_chunks * blocks_per_chunk, *t.shape[1:]), dtype=t.dtype) for t in self.tensors]
        self.finished: list[TransferResult] = []
        self.stores = self.loads = 0

    def _host_rows(self, chunk_ids, gpu_spec) -> torch.Tensor:
        """Host rows of the GPU blocks of ``gpu_spec`` (one KV cache group), in order."""
        assert len(gpu_spec.group_sizes) == 1, "one KV cache group"
        skip = gpu_spec.block_indices[0] % self.per
        rows = [int(chunk_ids[(skip + k) // self.per]) * self.per + (skip + k) % self.per
                for k in range(len(gpu_spec.block_ids))]
        return torch.tensor(rows, dtype=torch.long)

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        rows = self._host_rows(dst_spec.block_ids, src_spec)
        blocks = torch.from_numpy(src_spec.block_ids).long()
        for tensor, host in zip(self.tensors, self.host):
            host[rows] = tensor[blocks]
        self.stores += 1
        self.finished.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        rows = self._host_rows(src_spec.block_ids, dst_spec)
        blocks = torch.from_numpy(dst_spec.block_ids).long()
        for tensor, host in zip(self.tensors, self.host):
            tensor[blocks] = host[rows]
        self.loads += 1
        self.finished.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids) -> None:
        """Every job is done when it is submitted."""


class HostCopyOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector with :class:`HostCopyWorker` moving its KV."""

    def register_kv_caches(self, kv_caches) -> None:
        worker = self.connector_worker
        spec = worker.spec
        worker.worker = HostCopyWorker(kv_caches.values(), spec.blocks_per_chunk, spec.num_chunks)


def offload_config(cpu_bytes: int, tokens_per_chunk: int) -> dict:
    """``kv_transfer_config`` of an engine that offloads KV to ``cpu_bytes`` of host
    memory in chunks of ``tokens_per_chunk`` through this connector."""
    return {
        "kv_connector": "HostCopyOffloadingConnector",
        "kv_connector_module_path": "host_offload",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "block_size": tokens_per_chunk},
    }
