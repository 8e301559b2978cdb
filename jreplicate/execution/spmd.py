"""SPMDExecutor: one ``jax.jit(jax.shard_map)`` program per step signature, shared by the
strategies whose replicas form one mesh (Mirrored, MultiWorker, TPU)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _porting
from jreplicate._tree import (
    check_fits,
    covers,
    deleted_array_error,
    is_array_like,
    map_checked,
    path_str,
    put_host_values,
    read_now,
    report,
)
from jreplicate.context import PerReplica
from jreplicate.execution import agreed, donation, fast, habits, nnx_args, weight_sharding
from jreplicate.execution.base import Executor
from jreplicate.execution.cache import ProgramCache, ProgramKey
from jreplicate.execution.program import (
    PER_REPLICA,
    REPLICATED,
    ArgKind,
    LeafKind,
    Program,
    Signature,
)
from jreplicate.layout import Layout

_MAX_ENTRIES = 64


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


class Home(NamedTuple):
    """An argument leaf that lives on one logical device of each replica: the step gets
    a replicated copy, and its new value goes back there afterwards."""

    leaf: int            # its flat index among the program's inputs
    logical_device: int


class _Placement(NamedTuple):
    """How ``run`` takes an array argument of one sharding (see
    :meth:`SPMDExecutor._placement`)."""

    kind: LeafKind       # as it enters the program
    copy: bool = False   # placed anew, replicated, for the step
    logical_device: int | None = None  # lives there: its new value goes back after


_AS_IS = _Placement(REPLICATED)


class Prepared(NamedTuple):
    """A call made ready for its program by :meth:`SPMDExecutor._prepare`."""

    program: Program
    arrays: list         # the program's inputs, flat: (batch, plain args, NNX state)
    treedef: Any         # of (batch, plain args, NNX state)
    node_pos: tuple[int, ...]  # positions of the NNX arguments (empty: none)
    state: Any           # the NNX arguments' state, or None
    variables: list | None  # their Variables when split as pytrees (nnx_args.split)
    homes: list[Home]    # inputs that live on one logical device
    traced: bool         # an input is traced by an outer jax.jit


class SPMDExecutor(Executor):
    """Compiles and runs steps on an SPMD mesh; see :mod:`jreplicate.execution.program`.

    Example (one element per replica assembled into a batch, then one step):
      >>> import jax, numpy as np, jreplicate as jr
      >>> from jreplicate.execution import SPMDExecutor
      >>> ex = SPMDExecutor(jr.MirroredStrategy().layout)
      >>> batch = ex.assemble([[np.full((3,), k, np.float32)] for k in range(8)],
      ...                     jax.tree.structure(0))  # replica k's element: [k, k, k]
      >>> float(ex.run(lambda ctx, x: ctx.all_sum(x.sum()), True, batch, (), steps=None,
      ...              donate_argnums=()))  # 3 * (0 + 1 + ... + 7)
      84.0
    """

    def __init__(self, layout: Layout, agreement: Any = None):
        super().__init__(layout)
        # Across processes: the channel on which a call's host-side arguments are agreed
        # (see jreplicate.execution.agreed); None on one process.
        self._agreement = agreement
        self._mesh = layout.mesh
        self._axis = layout.replica_axis
        self._num_replicas = layout.num_replicas
        self._replicated = layout.replicated
        self._per_replica = layout.per_replica
        self._cache = ProgramCache(_MAX_ENTRIES)
        self._node_positions = nnx_args.NodePositions()
        # The (replica, 1) sub-mesh of each logical device, and back.
        self._logical = [_logical_submesh(self._mesh, i)
                         for i in range(layout.logical_devices_per_replica)]
        self._logical_index = {m: i for i, m in enumerate(self._logical)}
        self._placements: dict = {self._replicated: _AS_IS}  # see _placement
        # Replica id -> its position among this process's replicas (see assemble).
        self._local_position = {r: k for k, r in enumerate(layout.local_replica_ids)}
        # (with weight_update_sharding, a state leaf passed again replicated, not as the
        # program stores it, takes the full path, which reshards it)
        self._fast = fast.FastPath(self._cache, self._mesh, self._axis,
                                   check_shardings=layout.logical_devices_per_replica > 1
                                   or layout.weight_update_sharding is not None)
        # (step, habit, line) already warned about (execution.habits.report)
        self._habits_reported: set = set()

    # -- state -----------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with jax.set_mesh(self._mesh):
            try:
                yield
            except ValueError as e:
                if "not found in mesh" not in str(e):
                    raise
                sizes = ", ".join(f"{k!r}: {v}" for k, v in self._mesh.shape.items())
                raise ValueError(
                    f"{e} The strategy's mesh has axes {{{sizes}}}: shard state over "
                    f"jr.MODEL_AXIS ({self._mesh.axis_names[-1]!r}), e.g. "
                    "nnx.with_partitioning(init, (None, jr.MODEL_AXIS)) or "
                    "NamedSharding(rep.mesh, P(None, jr.MODEL_AXIS)); create the strategy "
                    "with logical_devices_per_replica=M to split it over M devices."
                ) from e

    @contextlib.contextmanager
    def logical_device_scope(self, logical_device_id: int) -> Iterator[None]:
        with jax.set_mesh(self._logical[logical_device_id]):
            yield

    def place(self, tree: Any) -> Any:
        # (a NumPy leaf is read now: on CPU the device array may alias what it is given)
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
        xs = [x for _, x in pairs]
        names = [lambda p=p: f"state {path_str(p) or 'the root'}" for p, _ in pairs]
        if self._agreement is None:
            placed, problems = put_host_values(xs, self._replicated, names)
            report(problems, "state")
            return jax.tree.unflatten(treedef, placed)
        # Across processes: agreed first, as run's arguments (jreplicate.execution.agreed).
        descs, hosts, problems = [], {}, []
        for k, x in enumerate(xs):
            if not agreed.is_host_side(x, False):
                descs.append(agreed.placed_leaf(x, "mesh"))
                continue
            try:
                hosts[k], desc = agreed.host_leaf(x, names[k])
            except (TypeError, ValueError) as e:
                problems.append(e)
                desc = "refused"
            descs.append(desc)
        agreed.agree(self._agreement, agreed.tree_text(treedef), descs, problems,
                     lambda k: names[k](), "state")
        placed = dict(zip(hosts, agreed.place(list(hosts.values()), self._replicated,
                                              [agreed.is_weak(xs[k]) for k in hosts])))
        return jax.tree.unflatten(treedef, [
            placed[k] if k in placed else jax.device_put(x, self._replicated)
            for k, x in enumerate(xs)])

    # -- input -----------------------------------------------------------------------
    def assemble(self, elements: Sequence[Sequence[np.ndarray]], treedef: Any) -> Any:
        # Each device's block straight from its replica's element, in one batched
        # transfer per leaf (no stacked host copy to slice again). On CPU the device
        # array may alias the element's memory: the caller's copies (see Executor).
        pos = self._local_position
        mesh, axis, sharding = self._mesh, self._axis, self._per_replica
        out = []
        for j in range(len(elements[0])):
            shape = (self._num_replicas,) + np.shape(elements[0][j])
            arr = jax.make_array_from_callback(
                shape, sharding,
                lambda index, j=j: elements[pos[index[0].start or 0]][j][None])
            out.append(PerReplica(arr, mesh, axis))
        return jax.tree.unflatten(treedef, out)

    def split_batch(self, batch: Any) -> Any:
        leaves = jax.tree.leaves(batch, is_leaf=_is_per_replica)
        if all(isinstance(x, PerReplica) for x in leaves):
            return batch
        return map_checked(
            lambda p, x: x if isinstance(x, PerReplica) else
            self._split(x, path_str(p) or "the root"),
            batch, "Replicator.run(fn, inputs)", is_leaf=_is_per_replica)

    def _split(self, x: Any, where: str) -> PerReplica:
        """A global batch as a PerReplica: replica r takes rows [r*b, (r+1)*b)."""
        n = self._num_replicas
        if not is_array_like(x):
            raise TypeError(
                f"Replicator.run(fn, inputs): inputs {where} is a {type(x).__name__}; inputs "
                "are a pytree of arrays (global batches) or PerReplica values. Pass other "
                "values as arguments after inputs."
            )
        shape = np.shape(x)
        if not shape or shape[0] % n:
            got = f"shape {tuple(shape)}" if shape else "a scalar"
            raise ValueError(
                f"Replicator.run(fn, inputs): inputs {where} has {got}; a plain array in "
                f"inputs is a global batch, split over the {n} replicas along its first axis, "
                f"so that axis must be divisible by {n}. Pass a global batch of a multiple "
                f"of {n} rows, a PerReplica of shape [{n}, ...] for per-replica values, or "
                "values every replica shares as arguments after inputs."
            )
        if isinstance(x, jax.core.Tracer):
            return PerReplica(x.reshape((n, shape[0] // n) + shape[1:]), self._mesh, self._axis)
        host = np.asarray(x)
        check_fits(host, f"Replicator.run(fn, inputs): inputs {where}")
        rows = shape[0] // n
        # Copies: the device arrays may alias them, and the caller may reuse its array.
        local = [[host[r * rows:(r + 1) * rows].copy()] for r in self.layout.local_replica_ids]
        return self.assemble(local, jax.tree.structure(0))

    # -- running ---------------------------------------------------------------------
    def run(self, fn: Callable, has_batch: bool, batch: Any, args: tuple, *,
            steps: int | None = None, donate_argnums: tuple[int, ...] = (),
            allow: frozenset = frozenset()) -> Any:
        call = self._prepare(fn, has_batch, batch, args, steps, donate_argnums)
        program, node_pos = call.program, call.node_pos
        jitted = program.jitted_nested if call.traced else program.jitted
        try:
            if not program.habits_checked:
                self._check_habits(fn, jitted, call, allow)
            flat = jitted(*call.arrays)
        except Exception as e:  # broad: any failed step is noted on its NNX
            # arguments, then re-raised
            if node_pos:
                nnx_args.note_failed_step(e, jax.tree.leaves(
                    [args[i] for i in node_pos], is_leaf=nnx_args.is_variable))
            raise
        if not (call.traced or call.homes) and (not node_pos or call.variables is not None):
            self._fast.record(fn, has_batch, batch, args, steps, donate_argnums, program,
                              call.arrays)
        mesh, axis = self._mesh, self._axis
        outs = [PerReplica(x, mesh, axis) if r else x
                for x, r in zip(flat, program.outputs_per_replica())]
        if call.homes:
            self._send_home(outs, call.homes, call.treedef, program)
        result = jax.tree.unflatten(program.out_tree, outs[:program.num_out])
        if node_pos:
            new_state = outs[program.num_out:] if call.variables is not None else \
                jax.tree.unflatten(jax.tree.structure(call.state), outs[program.num_out:])
            nnx_args.write_back(args, node_pos, new_state, call.variables)
        return result

    def run_again(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
                  steps: int | None, donate_argnums: tuple[int, ...]) -> Any:
        return self._fast.call(fn, has_batch, batch, args, steps, donate_argnums)

    def compiled(self, fn: Callable, has_batch: bool, batch: Any, args: tuple, *,
                 steps: int | None = None, donate_argnums: tuple[int, ...] = (),
                 allow: frozenset = frozenset()) -> Any:
        """The ``jax.stages.Compiled`` program ``run`` would call (for inspection:
        ``.as_text()``, ``.memory_analysis()``); runs nothing."""
        call = self._prepare(fn, has_batch, batch, args, steps, donate_argnums)
        if not call.program.habits_checked:
            self._check_habits(fn, call.program.jitted, call, allow)
        return call.program.jitted.lower(*call.arrays).compile()

    def state_shardings(self, fn: Callable, has_batch: bool, batch: Any, args: tuple, *,
                        steps: int | None = None) -> tuple:
        """Per argument, the shardings ``run`` gives its new value (a pytree of
        ``NamedSharding``; an NNX argument's as an ``nnx.State``); traces, runs nothing.
        ``batch`` and ``args`` may hold ``jax.ShapeDtypeStruct`` leaves."""
        call = self._prepare(fn, has_batch, self._abstract_batch(batch), args, steps, ())
        program = call.program
        if program.split is not None:
            program.split.ensure(call.arrays)
            stored = program.split.in_shardings
        else:
            stored = ()
        return weight_sharding.argument_shardings(
            program.kinds, stored, self.layout, call.treedef, call.node_pos, args,
            call.variables, call.state)

    def _abstract_batch(self, batch: Any) -> Any:
        """A global batch of ``jax.ShapeDtypeStruct`` leaves as the PerReplica blocks a
        step takes (other batches as ``run`` takes them)."""
        leaves = jax.tree.leaves(batch, is_leaf=_is_per_replica)
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            return self.split_batch(batch) if batch is not None else batch
        n = self._num_replicas

        def block(path, x):
            if not isinstance(x, jax.ShapeDtypeStruct):
                return self._split(x, path_str(path) or "the root")
            if not x.shape or x.shape[0] % n:
                raise ValueError(
                    f"Replicator.state_shardings: inputs {path_str(path) or 'the root'} has "
                    f"shape {x.shape}; a global batch needs a first axis divisible by {n}.")
            shape = (n, x.shape[0] // n) + tuple(x.shape[1:])
            return PerReplica(jax.ShapeDtypeStruct(shape, x.dtype, sharding=self._per_replica),
                              self._mesh, self._axis)

        return jax.tree_util.tree_map_with_path(block, batch, is_leaf=_is_per_replica)

    def _check_habits(self, fn: Callable, jitted: Any, call: Prepared,
                      allow: frozenset) -> None:
        """Warns about the pmap habits in the step's trace (:mod:`.habits`), once per
        program, at its first call: the trace is JAX's own (``jitted`` reuses it), so
        this costs one reading of the jaxpr, and nothing afterwards."""
        if self._num_replicas > 1:
            traced = jitted.trace(*call.arrays)  # the step's own errors raise here
            try:
                found = habits.find(traced.jaxpr, self._axis, self._num_replicas)
            except Exception as e:  # noqa: BLE001 - a detector's fault never stops a step
                habits.log_failure(fn, e)
                found = []
            habits.report(found, habits.step_name(fn), allow, self._num_replicas,
                          self._habits_reported)
        call.program.habits_checked = True

    def _prepare(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
                 steps: int | None, donate_argnums: tuple[int, ...]) -> Prepared:
        """The program for this call's signature (built on first use) and its inputs."""
        node_pos = self._node_positions(args)
        graphdef = state = variables = None
        plain = args
        if node_pos:
            graphdef, state, plain, variables = nnx_args.split(args, node_pos)
        leaves, treedef = jax.tree.flatten((batch, plain, state), is_leaf=_is_per_replica)
        homes: list[Home] = []
        arrays, kinds, traced = self._place(leaves, treedef, node_pos, homes)
        key = ProgramKey(
            has_batch, treedef, graphdef, node_pos, kinds, steps, donate_argnums,
            tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in arrays))
        program = self._cache.get(fn, key)
        if program is None:
            if node_pos and variables is None:
                nnx_args.check_writable(args, node_pos, state)
            groups = _argument_leaves(treedef, node_pos, donate_argnums, len(args))
            donate = _donated_leaves(treedef, groups)
            sig = Signature(has_batch, treedef, graphdef, node_pos, kinds, steps, donate,
                            groups)
            program = self._cache.put(fn, key, lambda f: Program(f, sig, self.layout))
        if program.split is not None and not traced:
            program.split.ensure(arrays)  # the plan: traced once, at the first call
            weight_sharding.place(arrays, kinds, program.split.in_shardings, self.layout)
        if node_pos:
            _copy_shared_state(arrays, treedef)
        if donate_argnums:
            _check_donated_once(arrays, program.jitted_donate, treedef, node_pos)
        if program.jitted_donate:
            copied = plain is not args  # a tuple of the plain arguments holds them too
            in_variable, containers = _containers(args, program.donate_args, treedef,
                                                  state if variables is None else None)
            donation.copy_held_elsewhere(
                arrays, _donation_limit(leaves, arrays, program.jitted_donate, treedef,
                                        args, copied, in_variable),
                args, donation.argument_limit(args, program.donate_args, copied, leaves),
                containers, lambda i: _may_alias(leaves[i], arrays[i]))
        return Prepared(program, arrays, treedef, node_pos, state, variables, homes, traced)

    def _place(self, leaves: list, treedef: Any, node_pos: tuple,
               homes: list) -> tuple[list, tuple, bool]:
        """The step's input arrays placed for the mesh, their kinds, and whether any is
        traced by an outer ``jax.jit``; logical-device arguments are noted in ``homes``.
        Every leaf that can't be an input is named in one error (:func:`_tree.report`).
        Across processes a call with a host-side leaf or a refused one agrees first, and
        every process takes the same path (:mod:`jreplicate.execution.agreed`)."""
        arrays, kinds, problems = [], [], []
        host: list = []  # (position in arrays, its leaf index, its name) to place
        copies: list[int] = []  # positions placed anew (after any agreement)
        leaf_of: list[int] = []  # the leaf index of each position (refused leaves skipped)
        traced = False
        replicated = self._replicated
        across = self._agreement is not None
        where = _LeafNames(treedef, node_pos)
        # (state with a device axis, from flax.jax_utils.replicate: agreed as a refusal)
        problems += _porting.device_axis_errors(_argument_groups(treedef, node_pos), leaves,
                                                where, self._mesh)
        for i, x in enumerate(leaves):
            try:
                if isinstance(x, PerReplica):
                    x = self._check_per_replica(x, i, where)
                    traced = traced or isinstance(x, jax.core.Tracer)
                    kind = PER_REPLICA
                elif isinstance(x, jax.core.Tracer):
                    traced = True  # under an outer jit: shard_map's in_specs place it
                    kind = REPLICATED
                elif isinstance(x, jax.ShapeDtypeStruct):  # state_shardings: traced only
                    s = x.sharding
                    kind = (self._placements.get(s) or self._placement(s)).kind \
                        if isinstance(s, NamedSharding) else REPLICATED
                elif isinstance(x, jax.Array) and x.is_deleted():
                    raise deleted_array_error(where(i))
                elif isinstance(x, jax.Array) and not (across and x.is_fully_addressable):
                    how = self._placements.get(x.sharding) or self._placement(x.sharding)
                    if how.copy:
                        if how.logical_device is not None:
                            # Lives on one logical device: a copy to the others for the
                            # step; its new value goes back there afterwards.
                            homes.append(Home(i, how.logical_device))
                        copies.append(len(arrays))
                    kind = how.kind
                elif is_array_like(x):
                    # Placed below, all at once (across processes, a jax.Array of this
                    # process's devices too: see agreed); counted before its own check.
                    host.append((len(arrays), i, lambda i=i: f"Replicator.run: {where(i)}"))
                    if isinstance(x, (np.ndarray, np.generic, int, float)):
                        check_fits(np.asarray(x), host[-1][2])
                    kind = REPLICATED
                else:
                    raise TypeError(
                        f"Replicator.run: {where(i)} is a {type(x).__name__}, not an array. "
                        "Arguments must be pytrees of arrays; close over other values in fn "
                        "(e.g. functools.partial(step, name=...)), built once outside the "
                        "training loop: a new function object each step compiles each step."
                    )
            except (TypeError, ValueError) as e:
                problems.append(e)
                continue
            arrays.append(x)
            kinds.append(kind)
            leaf_of.append(i)
        if across and (host or problems):
            self._agree_and_place(leaves, treedef, arrays, kinds, leaf_of,
                                  {pos for pos, _, _ in host}, problems, where)
        elif host and not problems:
            # (On one process nothing is agreed: a value already refused is not placed,
            # as placing it could raise JAX's own error first.)
            placed, problems = put_host_values([leaves[i] for _, i, _ in host], replicated,
                                               [w for _, _, w in host])
            for (pos, _, _), x in zip(host, placed):
                arrays[pos] = x
        report(problems, "Replicator.run")
        for pos in copies:  # (a collective program across processes: after the agreement)
            arrays[pos] = jax.device_put(arrays[pos], replicated)
        return arrays, tuple(kinds), traced

    def _agree_and_place(self, leaves: list, treedef: Any, arrays: list, kinds: list,
                         leaf_of: list[int], host: set[int], problems: list,
                         where: _LeafNames) -> None:
        """Across processes: one agreement on every leaf of the call (each host-side
        one, at the positions ``host`` of ``arrays``, by its digest) and on what each
        process refused; then each host-side leaf is placed from this process's copy
        (no collective). Raises the agreed error, the same on every process."""
        descs = ["refused"] * len(leaves)
        hosts = {}
        for pos, (x, i) in enumerate(zip(arrays, leaf_of, strict=True)):
            if pos in host:
                try:
                    hosts[pos], descs[i] = agreed.host_leaf(
                        leaves[i], lambda i=i: f"Replicator.run: {where(i)}")
                except (TypeError, ValueError) as e:
                    problems.append(e)
            else:
                descs[i] = agreed.placed_leaf(
                    x, "per-replica" if kinds[pos] is PER_REPLICA else "mesh")
        batch_t, plain_t, _ = treedef.children()
        shown = plain_t if batch_t.num_leaves == 0 else treedef  # the arguments, as passed
        agreed.agree(self._agreement, agreed.tree_text(treedef, shown), descs, problems,
                     where, "Replicator.run")
        weak = [agreed.is_weak(leaves[leaf_of[pos]]) for pos in hosts]
        for pos, x in zip(hosts, agreed.place(list(hosts.values()), self._replicated, weak)):
            arrays[pos] = x
        problems.clear()  # agreed: none, or raised above

    def _placement(self, s: Any) -> _Placement:
        """How ``run`` takes an argument with sharding ``s``: as it is, replicated or
        split over the model axis (:attr:`ArgKind.MODEL_SHARDED`: the step keeps the
        split on the argument's new value); copied replicated from logical device
        ``i``, its new value sent back there; or copied replicated."""
        if isinstance(s, NamedSharding) and s.mesh == self._mesh:
            spec = s.spec
            if self.layout.weight_update_sharding is not None:
                # stored sharded over the replicas by an earlier run: the same program
                spec = weight_sharding.without_axis(spec, self._axis)
            split = _spec_axes(spec) and self.layout.logical_devices_per_replica > 1
            how = _Placement(LeafKind(ArgKind.MODEL_SHARDED, spec)) if split else _AS_IS
        elif isinstance(s, NamedSharding) and s.mesh in self._logical_index:
            how = _Placement(REPLICATED, copy=True,
                             logical_device=self._logical_index[s.mesh])
        else:
            how = _Placement(REPLICATED, copy=True)
        if len(self._placements) < 1024:
            self._placements[s] = how
        return how

    def _check_per_replica(self, x: PerReplica, i: int, where: _LeafNames) -> Any:
        if x.mesh is not None and x.mesh is not self._mesh and x.mesh != self._mesh:
            raise ValueError(
                f"Replicator.run: {where(i)} is a PerReplica value from another Replicator "
                "(a different mesh). Pass values produced by this Replicator's "
                "prepare_input or run."
            )
        shape = getattr(x.array, "shape", ())
        if not shape or shape[0] != self._num_replicas:
            # shard_map would split a longer leading axis into blocks and each
            # replica would silently take its block's first row.
            raise ValueError(
                f"Replicator.run: {where(i)} is a PerReplica whose "
                f"array has shape {tuple(shape)}, but it needs a leading axis of one value "
                f"per replica ({self._num_replicas}). Build it as PerReplica(array of "
                f"shape [{self._num_replicas}, ...]), or pass a plain array to give "
                "every replica the same value."
            )
        if isinstance(x.array, jax.Array) and not isinstance(x.array, jax.core.Tracer) \
                and x.array.is_deleted():
            raise deleted_array_error(where(i))
        return read_now(x.array)

    def _send_home(self, outs: list, homes: list[Home], treedef: Any,
                   program: Program) -> None:
        """Puts the new values of arguments that live on one logical device back there:
        the NNX state leaves, and the leaves of plain arguments the step returned first
        (as in ``return params, opt_state, loss``)."""
        batch_t, plain_t, _ = treedef.children()
        nb, np_ = batch_t.num_leaves, plain_t.num_leaves
        for i, ld in homes:
            if nb <= i < nb + np_:
                if not program.returns_args:
                    continue
                k = i - nb
            elif i >= nb + np_:
                k = program.num_out + i - nb - np_
            else:
                continue
            x = outs[k]
            if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
                sub = self._logical[ld]
                shards = {s.device: s.data for s in x.addressable_shards}
                outs[k] = jax.make_array_from_single_device_arrays(
                    x.shape, NamedSharding(sub, P()),
                    [shards[d] for d in sub.devices.flat if d in shards])

    # -- results ---------------------------------------------------------------------
    def reduce(self, reduce_op: str, value: Any) -> Any:
        n = self._num_replicas

        def red(x):
            if isinstance(x, PerReplica):
                return _REDUCERS[reduce_op](x.array)
            x = jnp.asarray(x)
            return x * n if reduce_op == "sum" else x

        return jax.tree.map(red, value, is_leaf=_is_per_replica)

    def local_results(self, value: Any) -> list[Any]:
        out = []
        for r in self.layout.local_replica_ids:
            out.append(jax.tree.map(
                lambda x: x[r] if isinstance(x, PerReplica) else self._replica_view(x, r),  # noqa: B023
                value, is_leaf=_is_per_replica))
        return out

    def _replica_view(self, x: Any, r: int) -> Any:
        """Replica ``r``'s copy of a replicated (possibly model-sharded) array, built from
        the shards already on its devices (no copy); other values as they are."""
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        devices = self.layout.replica_devices[r]
        on = {s.device: s for s in x.addressable_shards if s.device in devices}
        if len(on) < len(devices):  # on one device of the replica (one logical device)
            whole = [s for s in on.values() if covers(s.index, x.shape)]
            return whole[0].data if whole else x
        if not isinstance(x.sharding, NamedSharding) \
                or self._axis in _spec_axes(x.sharding.spec):
            return x  # not held whole by this replica's devices
        if len(devices) == 1:
            return on[devices[0]].data
        sub = _submesh(self._mesh, r)
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(sub, x.sharding.spec),
            [on[d].data for d in sub.devices.flat])


# Reductions over the leading replica axis of a PerReplica's global array.
_REDUCERS: dict[str, Callable] = {
    "sum": jax.jit(functools.partial(jnp.sum, axis=0)),
    "mean": jax.jit(functools.partial(jnp.mean, axis=0)),
}


@functools.lru_cache(maxsize=256)
def _submesh(mesh: Mesh, r: int) -> Mesh:
    """Replica ``r``'s devices, as a ``(1, logical devices)`` mesh."""
    return Mesh(mesh.devices[r:r + 1], mesh.axis_names, axis_types=mesh.axis_types)


def _logical_submesh(mesh: Mesh, i: int) -> Mesh:
    """Logical device ``i`` of every replica, as a ``(replicas, 1)`` mesh."""
    return Mesh(mesh.devices[:, i:i + 1], mesh.axis_names, axis_types=mesh.axis_types)


def _spec_axes(spec: Any) -> set:
    axes = set()
    for part in spec:
        if isinstance(part, tuple):
            axes.update(part)
        elif part is not None:
            axes.add(part)
    return axes


def _argument_leaves(treedef: Any, node_pos: tuple, donate_argnums: tuple[int, ...],
                     num_args: int) -> tuple:
    """The donated plain arguments."""
    batch_t, plain_t, _ = treedef.children()
    sizes = [c.num_leaves for c in plain_t.children()]
    plain_ids = [i for i in range(num_args) if i not in node_pos]
    start = batch_t.num_leaves
    out = []
    for k, i in enumerate(plain_ids):
        if i in donate_argnums:
            out.append(donation.DonatedArgument(i, tuple(range(start, start + sizes[k]))))
        start += sizes[k]
    return tuple(out)


def _argument_groups(treedef: Any, node_pos: tuple) -> list[tuple[str, range]]:
    """``(name, flat leaf indices)`` of each plain argument, and of the NNX arguments'
    state as one (see :func:`jreplicate._porting.device_axis_errors`)."""
    batch_t, plain_t, state_t = treedef.children()
    start = batch_t.num_leaves
    children = plain_t.children()
    ids = [i for i in range(len(children) + len(node_pos)) if i not in node_pos]
    out = []
    for i, child in zip(ids, children):
        out.append((f"argument [{i}]", range(start, start + child.num_leaves)))
        start += child.num_leaves
    if node_pos:
        out.append((f"the state of the Flax NNX argument(s) {list(node_pos)}",
                    range(start, start + state_t.num_leaves)))
    return out


def _donated_leaves(treedef: Any, groups: tuple) -> tuple[int, ...]:
    """Flat leaf indices of the donated plain arguments (``groups``) and of all NNX
    state (which ``run`` replaces in place, so its old buffers are never read again)."""
    state_start = treedef.num_leaves - treedef.children()[2].num_leaves
    return tuple(i for arg in groups for i in arg.leaves) + \
        tuple(range(state_start, treedef.num_leaves))


def _copy_shared_state(arrays: list, treedef: Any) -> None:
    """NNX state is always donated, so an array held by two Variables (e.g. an EMA copy
    set from the parameters) or also passed as another argument would be donated twice,
    which XLA refuses: such a state leaf gets its own copy for the step. (The Variables
    stay two Variables: each gets its own new value.)"""
    batch_t, plain_t, _ = treedef.children()
    start = batch_t.num_leaves + plain_t.num_leaves
    seen = {id(x) for x in arrays[:start]}
    for i in range(start, len(arrays)):
        if id(arrays[i]) in seen:
            arrays[i] = jnp.copy(arrays[i])
        seen.add(id(arrays[i]))


def _containers(args: tuple, groups: tuple, treedef: Any, state: Any
                ) -> tuple[frozenset, list]:
    """What ``_prepare`` counts of the containers in the donated arguments
    (:class:`donation.Containers`): those inside the donated plain arguments (``groups``)
    and, for NNX state split by ``nnx.split`` (``state``; None: split as pytrees, every
    Variable holding one array), those inside Variables' values. Also the flat indices
    of that state's leaves inside Variables (the state holds the Variable, not them)."""
    out = [donation.Containers(args, k, plan, idx[0]) for k, idx in groups
           if idx and (plan := donation.container_plan(args[k], 1)) is not None]
    if state is None:
        return frozenset(), out
    in_variable = []
    start = treedef.num_leaves - treedef.children()[2].num_leaves
    for x in jax.tree.leaves(state, is_leaf=nnx_args.is_variable):
        if not nnx_args.is_variable(x):
            start += 1
            continue
        n = len(jax.tree.leaves(x))
        in_variable.extend(range(start, start + n))
        if n and (plan := donation.container_plan(x)) is not None:
            out.append(donation.Containers((x,), 0, plan, start))
        start += n
    return frozenset(in_variable), out


def _may_alias(x: Any, a: Any) -> bool:
    """Whether the program input ``a`` (for the leaf ``x`` as passed) may share buffers
    with what the caller holds: a concrete array passed as one, or in a PerReplica."""
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and \
        isinstance(x, (jax.Array, PerReplica))


def _donation_limit(leaves: list, arrays: list, donated: tuple[int, ...], treedef: Any,
                    args: tuple, plain_copied: bool, in_variable: frozenset) -> tuple:
    """The most references each donated leaf may have in ``_prepare`` for nothing else
    to hold it (see :mod:`jreplicate.execution.donation`): its holder, ``arrays``,
    ``leaves`` (unless a PerReplica holds it), NNX state's list of values or, split by
    ``nnx.split``, its State (which holds the leaves not inside a Variable: not those of
    ``in_variable``), the tuple of plain arguments when it is not ``args`` itself. A leaf
    placed anew for the step (from one logical device) may share the buffers of the leaf
    passed: the passed one is counted then, and a copy is donated (limit 0) if anything
    else holds it."""
    state_start = treedef.num_leaves - treedef.children()[2].num_leaves
    direct = {id(a) for a in args}
    out = []
    for i in donated:
        a = arrays[i]
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
            continue  # under an outer jax.jit: the caller's program decides
        x = leaves[i]
        placed = x is not a and isinstance(x, jax.Array)
        kind = donation.holder(x, x if placed else a, direct, i >= state_start)
        own = 1 + (i >= state_start and i not in in_variable) + \
            (kind == donation.ARGUMENT and plain_copied)
        if placed:  # x: held by leaves, this loop's x, getrefcount's argument
            if sys.getrefcount(x) > kind + own + 2:
                out.append((i, 0))
            continue
        out.append((i, kind + own + (x is a) + 1))
    return tuple(out)


def _check_donated_once(arrays: list, donated: tuple[int, ...], treedef: Any,
                        node_pos: tuple) -> None:
    """A donated array must not also be passed elsewhere in the same call (XLA would
    fail in the middle of the call); every such leaf is named in one error."""
    ids = {id(arrays[i]): i for i in donated}
    where = _LeafNames(treedef, node_pos)
    report([ValueError(
        f"Replicator.run: {where(i)} is donated (donate_argnums), but the same array "
        f"is also passed as {where(j)}. A buffer can be donated only if nothing else "
        "in the call reads it: drop it from donate_argnums, or pass a copy "
        "(jnp.copy(x)) in one of the places.")
        for j, i in ((j, ids.get(id(x))) for j, x in enumerate(arrays))
        if i is not None and i != j], "Replicator.run")


class _LeafNames:
    """``names(i)``: flat leaf ``i``'s name (:func:`_leaf_paths`, computed once, when an
    error first needs it)."""

    __slots__ = ("_treedef", "_node_pos", "_names")

    def __init__(self, treedef: Any, node_pos: tuple):
        self._treedef, self._node_pos, self._names = treedef, node_pos, None

    def __call__(self, i: int) -> str:
        if self._names is None:
            self._names = _leaf_paths(self._treedef, self._node_pos)
        return self._names[i]


def _leaf_paths(treedef: Any, node_pos: tuple) -> list[str]:
    """Names each leaf of ``(batch, plain args, NNX state)`` as the user passed it: a plain
    argument's index counts the NNX arguments taken out before it."""
    dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    names = {"0": "the input batch", "1": "argument", "2": "an NNX module's state"}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(dummy, is_leaf=_is_per_replica)[0]:
        head = names.get(str(path[0].idx), "input") if path else "input"
        if head == "argument" and len(path) > 1:
            k = path[1].idx  # index among the plain arguments
            i = [j for j in range(k + len(node_pos) + 1) if j not in node_pos][k]
            out.append(f"argument [{i}]{path_str(path[2:])}")
        else:
            out.append(f"{head} {path_str(path[1:])}".strip())
    return out
