"""`Trainer`: builds mesh, sharded state, data and the compiled step from a Config, then runs the loop."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from mlm_jax.checkpoint import state as ckpt
from mlm_jax.config import Config, ConfigError, to_yaml
from mlm_jax.data import loader as data_lib
from mlm_jax.data.dataset import build_datasets
from mlm_jax.eval.tasks import evaluate_training
from mlm_jax.infer.generate import generate
from mlm_jax.model import axes as ax
from mlm_jax.model.embed import master_tables
from mlm_jax.model.linear import master_kernels
from mlm_jax.model.transformer import STACKS, layer_kinds, model_spec
from mlm_jax.parallel import sharding as shd
from mlm_jax.parallel.distributed import shared_time
from mlm_jax.parallel.pipeline import pipeline_loss, pipeline_value_and_grad
from mlm_jax.parallel.schedule import SCHEDULES, Schedule
from mlm_jax.parallel.stages import ChunkLayout, chunk_sizes
from mlm_jax.parallel.stash import Stash
from mlm_jax.setup import setup
from mlm_jax.train import hooks as hk
from mlm_jax.train import metrics as mt
from mlm_jax.train.dashboards import dashboards
from mlm_jax.train.loss import head_loss
from mlm_jax.train.memory import capacity, compile_refusal, memory_report
from mlm_jax.train.optimizer import make_optimizer, schedule
from mlm_jax.train.state import TrainState, abstract_state, init_params, init_state, opt_state_shardings, state_shardings
from mlm_jax.train.step import StepPlan, eval_loss, gradients, train_step
from mlm_jax.validation.config import check_resume, check_weights
from mlm_jax.validation.plan import matmuls


class TrainingStopped(RuntimeError):
    """Training ended early on purpose (`train.nan_policy=stop`); the message is one line."""


class Trainer:
    """Notebook and CLI entry point: `Trainer(cfg).fit()`, `.evaluate()`, `.model`, `.state`.

    `keep_gradients`: each train step also returns its gradients (at the weights before its update, in the master
    layout), which `fit` leaves in `last_gradients`: what a layout computes, read from the very program that trains,
    at the cost of the memory of every gradient written out; `gradients()` compiles a program of its own instead."""

    def __init__(self, cfg: Config, devices=None, *, keep_gradients: bool = False):
        devices = list(devices) if devices is not None else jax.devices()
        self.keep_gradients, self.last_gradients = keep_gradients, None
        self.setup = setup(cfg, devices)  # every rule checked before anything is traced or written
        self.plan = self.setup.plan
        self.degrees, self.accum_steps = self.plan.degrees, self.plan.accum_steps
        if cfg.train.output_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(shared_time()))  # one name on every process
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=f"runs/{cfg.name}-{stamp}"))
        if cfg.checkpoint.dir is None:
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
                cfg.checkpoint, dir=os.path.join(cfg.train.output_dir, "checkpoints")))
        self.cfg = cfg
        self.is_main = jax.process_index() == 0
        self.mesh, self.rules, self.resolver = self.setup.mesh, self.setup.rules, self.setup.resolver

        self._build_data()
        self._build_state()
        self.build_steps()

        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.spec.shapes))
        t = cfg.train
        self.flops_per_token = mt.flops_per_token(cfg.model, self.num_params, t.seq_len)
        self.peak = mt.peak_flops(devices[0].device_kind) if devices[0].platform == "gpu" else None
        if self.is_main:
            os.makedirs(t.output_dir, exist_ok=True)
            with open(os.path.join(t.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
        self.log = mt.MetricsLog(t.output_dir, t.steps, cfg.log.progress, enabled=self.is_main)

    # -- construction --------------------------------------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.data = build_datasets(cfg.data, t.seq_len, cfg.model.vocab_size, t.seed)
        self.loader = data_lib.StepLoader(self.data.train, t.seq_len, t.global_batch_size, t.seed)
        shape_of = shd.mesh_shape(self.mesh)
        self.batch_sharding = NamedSharding(
            self.mesh, shd.resolve((ax.ACT_BATCH, None), self.rules, shape_of, (t.global_batch_size, t.seq_len)))

    def _build_state(self) -> None:
        cfg, mesh = self.cfg, self.mesh
        self.spec = model_spec(cfg.model, self.plan.kernels)  # the model as one device runs it (`model`)
        self.param_specs = shd.param_specs(self.spec.names, self.spec.shapes, mesh, self.rules)
        if cfg.parallel.shard_optimizer:
            self.master_specs = jax.tree.map(lambda s, x: shd.zero1_spec(s, x.shape, mesh), self.param_specs,
                                             self.spec.shapes, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        else:
            self.master_specs = self.param_specs
        self.master_shardings = shd.named(mesh, self.master_specs)
        self.tx = make_optimizer(cfg.optim, cfg.train.steps)
        self.lr_schedule = schedule(cfg.optim, cfg.train.steps)
        opt_shardings = opt_state_shardings(self.tx, self.spec.shapes, self.master_shardings, mesh)
        abstract = abstract_state(self.tx, self.spec.shapes, self.master_shardings, opt_shardings, mesh)
        c = cfg.checkpoint
        self.resumed_from = None
        # _resume and init_from before the Checkpointer (which creates the directory): a refused start writes
        # nothing, and the manager lists the steps only after unreadable checkpoints are moved aside
        self._abstract, self._opt_shardings = abstract, opt_shardings
        resumed = self._resume(abstract)
        if resumed is None and c.init_from:
            resumed = self._init_from(abstract)
        self._state = resumed  # None: a new run, whose weights `state` makes once `fit` has checked the step fits
        self.checkpointer = ckpt.Checkpointer(c.dir, c.every, c.keep) if c.save else None

    def _init_from(self, abstract: TrainState) -> TrainState:
        """`checkpoint.init_from`'s weights (refused in one line where their shapes differ) and a fresh optimizer."""
        cfg, c = self.cfg, self.cfg.checkpoint

        def check_init(step: int, meta: dict, mismatch: str | None) -> None:
            check_weights(cfg, meta.get("config") or {}, "checkpoint.init_from", f"{c.init_from} (step {step})",
                          mismatch)
        params, _ = ckpt.restore_params(c.init_from, abstract.params, check=check_init)
        return init_state(self.tx, params, self._opt_shardings, self.mesh)

    @property
    def state(self) -> TrainState:
        """The train state. A new run's weights are made on first use: `fit` compiles its step and checks that it
        fits from the state's shapes first, so that a step that cannot fit is refused before any weight takes
        device memory (and XLA's autotuner, compiling, has the device's memory to itself)."""
        if self._state is None:
            params = init_params(self.cfg.model, self.cfg.train.seed, self.master_shardings)
            self._state = init_state(self.tx, params, self._opt_shardings, self.mesh)
        return self._state

    @state.setter
    def state(self, value: TrainState) -> None:
        self._state = value

    def _steps_done(self) -> tuple[int, int]:
        """(steps done, steps skipped), without making a new run's weights."""
        if self._state is None:
            return 0, 0
        return int(self._state.step), int(self._state.skipped_steps)

    def _resume(self, abstract: TrainState) -> TrainState | None:
        """`checkpoint.resume`: auto (the newest complete checkpoint in `checkpoint.dir`), none, or a path.

        Refuses (before anything is read but the meta JSON and the arrays' metadata) weights of other shapes, and
        to continue with another seed or data blend than the checkpoint's, which would change the data order, unless
        `checkpoint.allow_data_change`. A new batch size or sequence length is allowed and reported in
        `resumed_from`.
        """
        c = self.cfg.checkpoint
        if c.resume == "none":
            if existing := ckpt.checkpoint_steps(c.dir):  # a save at an existing step is skipped: never mixed in
                raise ConfigError(f"checkpoint.resume=none, but checkpoint.dir={c.dir} already holds steps "
                                  f"{existing}, which a new run's saves would not replace: set another "
                                  f"train.output_dir or checkpoint.dir, or checkpoint.resume=auto")
            return None
        if c.resume == "auto":
            directory, steps = c.dir, ckpt.checkpoint_steps(c.dir)
            if not steps:
                return None
        else:
            directory, steps = ckpt.locate(c.resume)
            if not steps:
                raise ConfigError(f"checkpoint.resume={c.resume}: no checkpoint found there")
        noted: list[str] = []

        def check(step: int, meta: dict, mismatch: str | None) -> None:
            noted[:] = check_resume(self.cfg, meta.get("config") or {}, f"{directory}/{step}", mismatch)

        move_aside = os.path.abspath(directory) == os.path.abspath(c.dir)  # only this run's own checkpoints
        state, meta = ckpt.restore(directory, steps, abstract, check=check, move_aside=move_aside)
        self.resumed_from = f"{directory}/{meta['step']}" + (f" ({', '.join(noted)})" if noted else "")
        return state

    def build_steps(self, schedule: Schedule | None = None, chunks: ChunkLayout | None = None) -> None:
        """Jits the train, gradient and eval steps; `schedule` and `chunks` (the config's pipeline and layer split
        by default) may also run the pipeline executor on a stage axis of size 1, which
        `benchmarks/pipeline_overhead.py` measures."""
        cfg, su = self.cfg, self.setup
        p = cfg.parallel
        if schedule is None and self.degrees["stage"] > 1:
            schedule = SCHEDULES[p.pipeline_schedule](self.degrees["stage"], p.virtual_stages, self.accum_steps)
        moe = cfg.model.moe if cfg.model.moe.enabled else None
        compute_dtype = jnp.dtype(cfg.model.dtype)
        eval_graphdef = model_spec(cfg.model, su.kernels).graphdef

        @functools.cache
        def masters():
            """(graphdef, kernel paths) of the products whose weight gradient can come as an fp32 product
            (`linear.CastWeight`): accumulated per layer, in plain accumulation or a pipeline's chunks, XLA adds it
            into the layer's fp32 sum in the epilogue. Both steps run this graphdef, so that the other products (the
            head's) also take their weight gradients as fp32 products, never rounded to bf16 before the sum. Built
            only for such steps (one abstract trace of the model)."""
            graphdef = model_spec(cfg.model, dataclasses.replace(su.kernels, master=True)).graphdef
            model = nnx.merge(graphdef, self.spec.shapes)
            return graphdef, master_kernels(model) | master_tables(model)

        self.schedule, self.chunks, pipeline, forward = schedule, None, None, None
        self.stash: Stash | None = None  # the executor's, told when the step is traced
        if schedule is not None:
            split = p.pipeline_layers if self.degrees["stage"] > 1 else "even"
            self.chunks = chunks or ChunkLayout(chunk_sizes(split, cfg.model, cfg.train.seq_len, schedule.stages,
                                                            schedule.virtual), schedule.stages, schedule.virtual,
                                                layer_kinds(cfg.model))
            kw = dict(mesh=self.mesh, schedule=schedule, moe=moe, layout=self.chunks,
                      loss_fn=functools.partial(head_loss, chunks=cfg.train.loss_chunks))
            pipeline = functools.partial(pipeline_value_and_grad, masters()[0], compute_dtype=compute_dtype,
                                         cast_once=masters()[1], on_stash=self._note_stash, **kw)
            forward = functools.partial(pipeline_loss, eval_graphdef, **kw)
        step_plan = StepPlan(
            graphdef=eval_graphdef, accum_steps=self.accum_steps, master_shardings=self.master_shardings,
            layout=lambda: su.layout,
            compute_shardings=shd.named(self.mesh, self.param_specs) if p.shard_optimizer else None,
            compute_dtype=compute_dtype, moe=moe, loss_chunks=cfg.train.loss_chunks,
            per_layer=() if cfg.model.scan_layers else STACKS, prepare=su.prepare, pipeline=pipeline,
            pipeline_loss=forward)
        if step_plan.per_layer_stacks(self.spec.shapes):  # accumulated per layer: weight gradients in fp32
            master_graphdef, cast_once = masters()
            step_plan = dataclasses.replace(step_plan, graphdef=master_graphdef, cast_once=cast_once)
        self.step_plan = step_plan

        def step(state, batch):  # named: the program is `jit_step` in dumps and profiles
            return train_step(step_plan, self.tx, self.lr_schedule, state, batch, self.keep_gradients)

        def eval_step(params, batch):
            return eval_loss(eval_plan, params, batch)

        eval_plan = dataclasses.replace(step_plan, graphdef=eval_graphdef)
        shardings = state_shardings(self._abstract)
        batch_shardings = dict.fromkeys(self.loader.keys, self.batch_sharding)
        kept = (self.master_shardings,) if self.keep_gradients else ()
        options, self.matmuls = matmuls(cfg.train.matmul_impl, self.mesh.devices.flat[0].platform, self.accum_steps,
                                        pipelined=schedule is not None)
        self._train_step = jax.jit(step, in_shardings=(shardings, batch_shardings),
                                   out_shardings=(shardings, None, *kept), donate_argnums=0, compiler_options=options)
        self._grads = jax.jit(functools.partial(gradients, step_plan),
                              in_shardings=(self.master_shardings, batch_shardings),
                              out_shardings=(None, self.master_shardings), compiler_options=options)
        self._eval_step = jax.jit(eval_step, in_shardings=(self.master_shardings, batch_shardings))
        self._compiled = None

    def sharding_report(self) -> str:
        return shd.sharding_report(self.rules, self.mesh, self.spec.shapes, self.spec.names, self.param_specs,
                                   self.master_specs)

    # -- public API ----------------------------------------------------------------------------------------------
    @property
    def model(self) -> nnx.Module:
        """The model with the current weights, callable as `model(tokens_BS) -> logits_BSV`."""
        return nnx.merge(self.spec.graphdef, self.state.params)

    def gradients(self, params=None, step: int | None = None, batch: dict | None = None) -> tuple[dict, dict]:
        """(metrics, gradients) of step `step`'s batch (default: the next step's), or of `batch` (host arrays by
        `loader.keys`, any number of rows the layout divides), at `params` (default: the current weights; host
        arrays are placed in the master layout), computed exactly as the train step computes them (same layout,
        microbatches, pipeline and kernels) but without an update; the gradients are in the master weights'
        layout."""
        step = int(self.state.step) if step is None else step
        params = self.state.params if params is None else jax.device_put(params, self.master_shardings)
        if batch is not None:
            return self._grads(params, {k: jax.device_put(v, self.batch_sharding) for k, v in batch.items()})
        return self._grads(params, data_lib.global_batch(self.loader, step, self.batch_sharding))

    def lowered_step(self, step: int | None = None) -> jax.stages.Lowered:
        """The train step lowered on step `step`'s batch (default: the next step's), for reading its program:
        `.as_text()`, or `.compile(compiler_options={"xla_dump_to": ...})` for XLA's passes."""
        step = int(self.state.step) if step is None else step
        return self._train_step.lower(self.state, data_lib.global_batch(self.loader, step, self.batch_sharding))

    def evaluate(self) -> float:
        """Mean loss over `train.eval_batches` fixed validation batches."""
        t = self.cfg.train
        losses = []
        for fields in data_lib.eval_fields(self.data.validation, t.seq_len, t.global_batch_size, t.eval_batches):
            batch = {k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda i, v=v: v[i])
                     for k, v in fields.items()}
            losses.append(self._eval_step(self.state.params, batch))
        return float(np.mean(jax.device_get(losses)))

    def generate(self, prompts, **kwargs) -> list[list[int]]:
        """`mlm_jax.generate` on the current weights, laid out as they train (same mesh and rules table)."""
        return generate(self.model, prompts, rules=self.rules, **kwargs)

    def evaluate_tasks(self) -> dict[str, float]:
        """`eval.tasks` through lm-evaluation-harness on the current weights, with the run's tokenizer and
        `train.seq_len` as the context: `eval/<task>/<metric>` for each number it reports."""
        return evaluate_training(self.model, self.cfg)

    def save(self) -> None:
        """Starts an async save of the current state (training goes on while it is written)."""
        if self.checkpointer is None:  # checkpoint.save=false: asked for by name
            c = self.cfg.checkpoint
            self.checkpointer = ckpt.Checkpointer(c.dir, c.every, c.keep)
        step = int(self.state.step)
        self.checkpointer.save(self.state, {"step": step, "data_step": step, "seed": self.cfg.train.seed,
                                            "config": self.cfg.to_dict()})

    def _wait_for_saves(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def fit(self, steps: int | None = None) -> list[dict]:
        """Train `steps` more steps (default: up to `train.steps`); returns the logged records.

        Saves every `checkpoint.every` steps and at the end of training (none of it with `checkpoint.save=false`).
        SIGTERM or SIGINT finishes the current step, saves and returns. With `train.nan_policy=stop`, a non-finite
        step saves the state (the bad update dropped) and raises `TrainingStopped`.
        """
        t = self.cfg.train
        start = self._steps_done()[0]
        end = t.steps if steps is None else start + steps
        if start >= end:
            return []
        records = hk.Records(self.log, lambda: dashboards(self.cfg) if self.is_main else [])
        throughput = hk.Throughput(start, t.global_batch_size * t.seq_len, self.flops_per_token,
                                   len(self.mesh.devices.flat), self.peak)
        hooks = hk.Hooks(self._hooks(start, throughput, records))
        prefetch = data_lib.Prefetcher(self.loader, self.batch_sharding, start)
        try:
            batch = prefetch.get(start)
            self._compile()
            self.log.start = time.perf_counter()
            throughput.restart()
            for step in range(start, end):
                if step > start:
                    batch = prefetch.get(step)
                hooks.before(step + 1)
                info = self._step(batch, step + 1, end)
                throughput.waited += info.waited
                hooks.after(info)
                if info.stop:
                    self._report_stop(info.stop, info.done)
                    break
        finally:
            hooks.close()
            prefetch.close()
            self.log.end_line()
            records.close()
            self._wait_for_saves()
        return records.items

    def _hooks(self, start: int, throughput: hk.Throughput, records: hk.Records) -> list[hk.Hook]:
        """The fit's side jobs in the order they run after a step (see each for why there)."""
        t, cfg = self.cfg.train, self.cfg
        hooks = [hk.Profile(cfg.log, t.output_dir, self.is_main),
                 hk.LogMetrics(t.log_every, throughput, records, self._local_devices())]
        if t.nan_policy == "stop":
            hooks.append(hk.StopOnNonFinite(t.log_every, start, self._steps_done()[1], self._stop_on_nan))
        hooks += [hk.Evaluate(t.eval_every, lambda: {"eval_loss": self.evaluate()}, throughput, records),
                  hk.Evaluate(cfg.eval.every if cfg.eval.tasks else 0, self.evaluate_tasks, throughput, records),
                  hk.StopOnSignal(t.log_every)]
        if cfg.checkpoint.save:
            hooks.append(hk.SaveCheckpoint(self.checkpointer.due, t.steps, self.save))
        return hooks

    def _local_devices(self) -> list:
        """This process's devices of the mesh (the only ones whose memory it can ask about)."""
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    @property
    def abstract_state(self) -> TrainState:
        """The train state's shapes and shardings (what the step is compiled from)."""
        return self._abstract

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Every field of a step's batch (`loader.keys`) as a shape in the batch's layout."""
        t = self.cfg.train
        return {k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), v.dtype, sharding=self.batch_sharding)
                for k, v in self.loader.fields(0, 0, 1).items()}

    def _note_stash(self, stash: Stash) -> None:
        self.stash = stash

    def compile_step(self) -> jax.stages.Compiled:
        """The train step compiled from the state's and the batch's shapes (nothing is made or moved): what `fit`
        runs, and what the layout planner reads (`mlm_jax.plan`)."""
        return self._train_step.lower(self._abstract, self.batch_shapes()).compile()

    def _compile(self) -> None:
        """Compiles the train step on the first fit only, then reports what the run is."""
        if self._compiled is not None:
            return
        state = self._abstract if self._state is None else self._state
        t0 = time.perf_counter()
        try:
            compiled = self.compile_step()
        except jax.errors.JaxRuntimeError as e:
            if (refusal := compile_refusal(e, state, self._local_devices())) is None:
                raise
            raise refusal from None
        self.compile_time_s = time.perf_counter() - t0
        self.memory = memory_report(compiled, state, capacity(self._local_devices()))
        self.memory.check()
        self._compiled = compiled
        if self.is_main:
            self._startup_report()

    def _step(self, batch: dict, done: int, end: int) -> hk.StepInfo:
        t0 = time.perf_counter()
        self.state, metrics, *kept = self._compiled(self.state, batch)
        waited = time.perf_counter() - t0
        if kept:
            self.last_gradients = kept[0]
        return hk.StepInfo(done, end, self.state, metrics, waited)

    def _report_stop(self, received: str, done: int) -> None:
        """After a signal's save, once written: the message then names a checkpoint that is complete."""
        self._wait_for_saves()
        self.log.end_line()
        if self.is_main:
            print(f"received {received}: " + (
                f"saved checkpoint at step {done} to {self.checkpointer.directory}/{done}" if self.cfg.checkpoint.save
                else f"stopped at step {done} without a checkpoint (checkpoint.save=false)"))

    def _stop_on_nan(self, first: int, last: int, dropped: int) -> None:
        """`train.nan_policy=stop`, checked on logged steps only (no host wait on the others): every non-finite
        update was dropped, so the weights saved here hold only finite ones."""
        where = f"step {last}" if first == last else f"steps {first}..{last}"
        stopped = f"non-finite loss or gradient in {where} (train.nan_policy=stop): {dropped} update(s) dropped"
        if not self.cfg.checkpoint.save:
            raise TrainingStopped(f"{stopped}, no checkpoint written (checkpoint.save=false)")
        self.save()
        self.checkpointer.wait()
        raise TrainingStopped(f"{stopped}, the weights saved to {self.checkpointer.directory}/{last}")

    def _startup_report(self) -> None:
        cfg = self.cfg
        layout = " x ".join(f"{a}={n}" for a, n in self.degrees.items() if n > 1) or "single device"
        print(f"mlm_jax: {cfg.name} | {self.num_params / 1e6:.2f}M parameters | {len(self.mesh.devices.flat)} "
              f"{jax.devices()[0].platform} device(s), {layout} | global batch {cfg.train.global_batch_size} x "
              f"{cfg.train.seq_len} tokens, {self.accum_steps} microbatch(es) | compiled in "
              f"{self.compile_time_s:.1f}s | output {cfg.train.output_dir}")
        print(f"data: {self.data.description}")
        print(self.memory.describe())
        experts = f" | experts: {self.plan.experts}" if self.plan.experts else ""  # what `plan.kernels` runs
        products = f" | matmuls: {self.matmuls}" if self.matmuls else ""
        print(f"kernels: attention: {self.plan.attention}{experts}{products}")
        if self.schedule is not None:
            s = self.schedule
            print(f"pipeline: {s.kind}, {s.stages} stages x {s.virtual} virtual, {s.microbatches} microbatches, "
                  f"{s.ticks} ticks, bubble {100 * s.bubble():.1f}% | layers per chunk: "
                  f"{', '.join(map(str, self.chunks.sizes))}" + (
                      f" | stash: {self.stash.describe()}" if self.stash else ""))
        moe, microbatches = cfg.model.moe, self.schedule.microbatches if self.schedule else self.accum_steps
        if moe.enabled and moe.aux_loss_coef > 0 and moe.aux_loss_scope == "microbatch" and microbatches > 1:
            print(f"moe: the load-balancing loss counts the expert loads of each of the {microbatches} microbatches "
                  f"(model.moe.aux_loss_scope=microbatch): the objective changes with their number; "
                  f"aux_loss_scope=global counts the step's" + (", for one more forward pass" if not self.schedule
                                                                else " (not with pipeline stages)"))
        if self.resumed_from:
            print(f"resumed from {self.resumed_from}")
        if cfg.log.sharding_report:
            print(self.sharding_report())
