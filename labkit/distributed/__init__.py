"""Distributed training built from scratch on torch.distributed: launching ranks, collectives with their
bytes on the wire, data parallel, ZeRO, pipeline and tensor parallel, gradient compression."""

from labkit.distributed.launch import RankFailed, default_backend, free_port, launch

__all__ = ["RankFailed", "default_backend", "free_port", "launch"]
