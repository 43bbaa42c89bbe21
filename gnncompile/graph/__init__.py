"""Graphs: the CSR container, statistics, loaders, vertex partitioners and per-rank shards."""

from .core import Graph, GraphStats
from .partition import PARTITIONERS, Partition, partition
from .shard import LocalGraph, Shard, build_shards
from .sampling import SampledBatch, sample_blocks
from .presample import PresampleWeights, SplitStats, presample, presampled_partition, split_stats

__all__ = ["Graph", "GraphStats", "PARTITIONERS", "Partition", "partition", "LocalGraph", "Shard", "build_shards",
           "SampledBatch", "sample_blocks", "PresampleWeights", "SplitStats", "presample", "presampled_partition",
           "split_stats"]
