"""The torch-native groups of a run: ``run.process_group`` and ``run.device_mesh(...)``.

:class:`NativeGroups` creates them through torch's own API (the ``tmrun`` backend registered with
``dist.Backend.register_backend``, then ``init_process_group`` and ``new_group``), so torch's
tables know them and every torch API that takes a group or a mesh takes them. It then keeps them
current:

- at a switch, :meth:`NativeGroups.attach` gives every group its transport in the new generation:
  the world group the generation's gloo group itself (the one the runtime votes on), each
  mesh-dimension group a gloo group of its members built on that generation's store;
- on a standby promoted to another rank than its shadow's, :meth:`NativeGroups.rebind` moves every
  group to the new rank's members, the meshes' coordinates with them, and FSDP2's cached shard
  rank of the tracked modules.

The world size cannot change under torch-native groups (DDP and FSDP2 were built for it): an
elastic resize of such a job raises :class:`NativeResize`, and the job restarts.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from tmrun.groups import abort, wrap
from tmrun.process_group import BACKEND, Guard, SwappableGroup, Transport


class NativeResize(BaseException):
    """A job with torch-native groups was asked to change its world size (a BaseException, like
    :class:`tmrun.swap.StateLost`: no retry path may swallow it; the job restarts)."""


_factory_of: list["NativeGroups"] = []  # the process's NativeGroups (at most one), for the backend factory


def _create(options: Any, backend_options: Any = None) -> SwappableGroup:
    """The ``tmrun`` backend's factory (torch calls it from ``init_process_group``/``new_group``)."""
    if not _factory_of:
        raise RuntimeError("the tmrun backend makes groups for tmrun's runtime only: use run.process_group")
    return _factory_of[0].made(list(options.global_ranks_in_group))


class NativeGroups:
    """The world group and the meshes of one run (created on first use)."""

    def __init__(self, rank: int, world_size: int, guard: Guard, timeout: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.guard = guard
        self.timeout = datetime.timedelta(seconds=timeout)
        self.world: SwappableGroup | None = None
        self.meshes: list[tuple[Any, torch.Tensor, list[SwappableGroup]]] = []  # mesh, layout, its groups by dim
        self._subgroups: list[SwappableGroup] = []  # the mesh-dimension groups, in creation order
        self._transports: list[_Gloo] = []  # what attach built for them (closed on the next)
        self._store: dist.Store | None = None  # the current generation's store (None in the sandbox)

    def made(self, members: list[int]) -> SwappableGroup:
        group = SwappableGroup(members or range(self.world_size), self.rank, self.guard)
        if members:
            self._subgroups.append(group)
        return group

    def create_world(self, transport: Transport | None, store: dist.Store | None) -> SwappableGroup:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed's default group already exists: with tmrun's runtime, "
                               "use run.process_group instead of init_process_group")
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        _factory_of[:] = [self]
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=self.rank, world_size=self.world_size)
        world = dist.distributed_c10d._get_default_group()
        assert isinstance(world, SwappableGroup)
        world.attach(transport)
        self.world, self._store = world, store if transport is not None else None
        return world

    def device_mesh(self, shape: Sequence[int], names: Sequence[str] | None) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        shape = tuple(int(n) for n in shape)
        if math.prod(shape) != self.world_size:
            raise ValueError(f"a mesh of shape {shape} has {math.prod(shape)} ranks; the job has {self.world_size}")
        assert self.world is not None
        layout = torch.arange(self.world_size).view(shape)
        if len(shape) == 1:
            mesh = DeviceMesh.from_group(self.world, "cpu", mesh_dim_names=tuple(names) if names else None)
            self.meshes.append((mesh, layout, [self.world]))
            return mesh
        groups = []
        for dim in range(len(shape)):
            mine = None
            for row in _rows(layout, dim):  # every rank creates every group, in the same order (torch's rule)
                group = dist.new_group(row, backend=BACKEND)
                if self.rank in row:
                    mine = group
                    mine.attach(self._dim_group(mine, self._store) if self._store is not None else None)
            groups.append(mine)
        mesh = DeviceMesh.from_group(groups, "cpu", mesh=layout, mesh_dim_names=tuple(names) if names else None)
        self.meshes.append((mesh, layout, groups))
        return mesh

    def check_size(self, world_size: int) -> None:
        """Raise :class:`NativeResize` when the next generation's world size is not this one's."""
        if self.world is not None and world_size != self.world_size:
            raise NativeResize(f"the job's world size would change from {self.world_size} to {world_size}, "
                               "but torch-native groups (DDP, FSDP2, a DeviceMesh) keep theirs: restarting")

    def attach(self, gloo: Transport | None, store: dist.Store | None, world_size: int) -> None:
        """The next generation: its gloo group for the world, one per mesh dimension on ``store``."""
        if self.world is None:
            return
        self.check_size(world_size)
        old, self._transports = self._transports, []
        self._store = store if gloo is not None else None
        self.world.attach(gloo)
        for group in self._subgroups:
            group.attach(self._dim_group(group, store) if gloo is not None and store is not None else None)
        for transport in old:
            transport.close()

    def close(self) -> None:
        """The current generation is over (broken, left, finished): let go of its connections, the
        mesh groups' and every forwarded work's, so that peers blocked in it fail at once."""
        if self.world is not None:
            self.world.release()
        for group in self._subgroups:
            group.release()
        for transport in self._transports:
            transport.close()

    def rebind(self, rank: int, modules: Iterable[Any] = ()) -> None:
        """This process takes global rank ``rank`` (a promoted standby's shadow ran as another)."""
        if rank == self.rank:
            return
        self.rank = rank
        if self.world is not None:
            self.world.rebind(self.world.members, rank)
        for mesh, layout, groups in self.meshes:
            coordinate = [int(c) for c in (layout == rank).nonzero()[0]]
            for dim, group in enumerate(groups):
                if group is not self.world:
                    group.rebind(_row_of(layout, dim, coordinate), rank)
            mesh._rank = rank
            mesh._coordinate_on_dim = coordinate
        for module in modules:
            _refresh_fsdp_ranks(module)

    def _dim_group(self, group: SwappableGroup, store: dist.Store) -> "_Gloo":
        index = self._subgroups.index(group)
        prefix = dist.PrefixStore(f"mesh{index}/" + ",".join(map(str, group.members)), store)
        gloo = _Gloo(prefix, group.getRank(), group.getSize(), self.timeout)
        self._transports.append(gloo)
        return gloo


def _rows(layout: torch.Tensor, dim: int) -> list[list[int]]:
    """The groups of mesh dimension ``dim``: ranks that differ in that coordinate only."""
    moved = layout.movedim(dim, -1)
    return [row.tolist() for row in moved.reshape(-1, layout.shape[dim])]


def _row_of(layout: torch.Tensor, dim: int, coordinate: list[int]) -> list[int]:
    index = list(coordinate)
    index[dim] = slice(None)
    return layout[tuple(index)].tolist()


def _refresh_fsdp_ranks(module: Any) -> None:
    """FSDP2 caches each group's shard rank when ``fully_shard`` runs: make it the new rank's."""
    if not isinstance(module, torch.nn.Module):
        return
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is None:
            continue
        for info in (group.mesh_info, getattr(group, "post_forward_mesh_info", None)):
            if info is not None and hasattr(info, "shard_mesh_rank"):
                info.shard_mesh_rank = info.shard_process_group.rank()


class _Gloo:
    """A mesh dimension's gloo group in one generation (the only holder of its connections)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._gloo: dist.ProcessGroupGloo | None = gloo
        self.native: dist.ProcessGroup | None = wrap(gloo, store, rank, size)

    def close(self) -> None:
        gloo, self._gloo, self.native = self._gloo, None, None
        abort(gloo)
