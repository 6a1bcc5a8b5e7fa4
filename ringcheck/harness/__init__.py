"""Running an implementation under the `--impl` contract on process groups: the one service
that validate, drift, bench, train and the pytest plugin use. `mesh` (the device mesh, its CP
groups), `call` (one rank's call: shards, input layouts, two calls), `runner` (a case on every
CP group of a mesh at once, the whole results gathered), `wrappers` (one rank's calls inside
activation checkpointing and under torch.compile), `embedding` (where a case runs, the
other groups' inputs, what a failure inside a mesh means)."""

from .mesh import CP, Mesh
from .runner import CALLS, TWO_CALLS, GroupRun, ImplOptions, Runner, impl_task, whole_results

__all__ = ["CALLS", "CP", "TWO_CALLS", "GroupRun", "ImplOptions", "Mesh", "Runner", "impl_task", "whole_results"]
