"""Distributed training built from scratch on torch.distributed: launching ranks, collectives with their
bytes on the wire, data parallel, ZeRO, pipeline and tensor parallel, gradient compression."""

from labkit.distributed.launch import RankFailed, default_backend, free_port, launch
from labkit.distributed.data_parallel import DataParallelBucket, DataParallelNaive, broadcast_parameters
from labkit.distributed.zero import Zero

__all__ = ["RankFailed", "default_backend", "free_port", "launch", "DataParallelNaive", "DataParallelBucket",
           "broadcast_parameters", "Zero"]
