"""The LightningModule: the model's own next-token loss, AdamW param groups, LR schedule, metrics.

It wraps a model whose ``forward(idx, targets, mask)`` returns the mean next-token loss (and
logits without ``targets``), ``bnlit.model.Transformer``, and knows nothing of data files;
optimizer and scheduler arrive as ``functools.partial`` objects from Hydra (``_partial_: true``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn

from bnlit import document_masking
from bnlit.speed import compile_ahead, sdpa
from bnlit.speed.compile import (CompileWatch, compile_line, compile_loss, compile_model, recompile_warning,
                                 thread_count_recompile)
from bnlit.errors import BnlitError
from bnlit.speed.fast_path import describe_fast_path
from bnlit.speed.profiling import marked_closure
from bnlit.loss import IGNORE_INDEX, loss_fn, logits_loss
from bnlit.loggers import checkpointed_row, log_metrics, restore_checkpointed_row
from bnlit.tokenizer import EOS_ID

log = logging.getLogger("bnlit")

# the same name as before for callers that score logits (the loss of an exported model's logits)
next_token_loss = logits_loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings get no weight decay. A tied matrix is
    the embedding (``named_parameters`` yields it once, under its first name)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embeddings" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a run's ``trainer.precision``: under bf16 the unsharded
    parameters are all-gathered in bf16 (half the traffic of fp32, and autocast finds them in bf16
    already) and gradients are reduce-scattered in fp32 (a sum over ranks in bf16 loses the low
    bits of every rank's contribution); the sharded parameters and optimizer states stay fp32.
    Any other precision all-gathers and reduces in the parameters' own dtype (torchtitan's
    ``mixed_precision_param``/``mixed_precision_reduce`` defaults are the same pair)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if "bf16" in str(precision):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: nn.Module, mesh, mp_policy=None) -> None:
    """FSDP2 (``fully_shard``) as torchtitan applies it: each transformer block is one unit (its
    parameters are gathered just before it runs and freed after), the root holds the embeddings,
    final norm and the (tied) head. Compile the blocks first (:func:`bnlit.speed.compile.compile_model`),
    so the compiled graphs contain no collectives. Lightning's mesh is (data_parallel = nodes, tensor_parallel =
    devices per node); bnlit has no tensor parallelism, so sharding over that 2-D mesh is HSDP:
    replicated across nodes (mesh dim 0), sharded within a node (dim 1). On one node it is plain
    FSDP. ``mp_policy``: :func:`mixed_precision_policy` (None: torch's default, no casts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def pad_rows(batch, rows: int | None):
    """An ``(x, y)`` batch with fewer than ``rows`` windows padded to ``rows`` by repeating its first
    window with every target ``IGNORE_INDEX``: the same mean loss, at the fixed shape."""
    x, y = batch
    missing = (rows or 0) - x.shape[0]
    if missing <= 0:
        return batch
    return (torch.cat([x, x[:1].expand(missing, -1)]),
            torch.cat([y, torch.full((missing, y.shape[1]), IGNORE_INDEX, dtype=y.dtype, device=y.device)]))


class LMModule(L.LightningModule):
    """Args:
    model: the transformer (``forward(idx, targets, mask) -> loss``; without targets, logits).
    optimizer: partial optimizer taking param groups (its ``weight_decay`` applies to matrices).
    scheduler: partial scheduler taking the optimizer, or None for a constant LR.
    compile: ``torch.compile`` each transformer block and the loss (:func:`bnlit.speed.compile.compile_model`;
        parameter names are kept; under FSDP2 before the blocks are sharded), and watch for
        recompiles (:class:`bnlit.speed.compile.CompileWatch`: a warning with Dynamo's reason).
    fullgraph: require a single graph when compiling.
    sdpa_backend: attention kernels (``bnlit.speed.sdpa``): ``auto`` lets PyTorch pick; on CPU only
        ``math`` changes anything (the math kernel instead of CPU flash).
    loss_impl: the output head's loss (``bnlit.loss``): ``plain``, ``chunked`` or ``fused`` (torch's
        ``F.linear_cross_entropy``, fp32 precision only).
    document_masking: attend only within a document of a packed window (``bnlit.document_masking``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        compile: bool = False,
        fullgraph: bool = False,
        sdpa_backend: str = "auto",
        loss_impl: str = "plain",
        document_masking: bool = True,
    ):
        super().__init__()
        sdpa.validate(sdpa_backend)
        # refused here, before the data module builds anything: a bad name, fused on a torch without it
        # (fused at a precision where it is wrong: bnlit.preflight, and configure_model below)
        loss_fn(loss_impl, "cuda" if torch.cuda.is_available() else "cpu")
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile, self.fullgraph, self.sdpa_backend = compile, fullgraph, sdpa_backend
        self.loss_impl, self.document_masking = loss_impl, document_masking
        # the kernel training steps dispatch (set in configure_model): "sdpa:flash", "sdpa:cudnn", "flex_attention", ...
        self.attention_kernel: str | None = None
        self._val_losses: list[tuple[torch.Tensor, int]] = []
        self._step_loss: torch.Tensor | None = None  # sum of this optimizer step's micro-batch losses
        self._configured = False
        self.fast_path: str | None = None  # the run's "fast path: ..." line, set at train start
        self.compile_watch: CompileWatch | None = None  # Dynamo's compiles in this process (compile: true)
        self._checkpointed_row: dict | None = None  # its own step's metrics row, from the checkpoint resumed
        self._batch_step = 0  # the optimizer step the current micro-batch trains in

    def configure_model(self) -> None:
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        self.model.loss_fn = loss_fn(self.loss_impl, device,
                                     str(self.trainer.precision) if self._trainer is not None else None)
        for layer in self.model.layers:
            layer.attention.sdpa = sdpa.kernel_fn(self.sdpa_backend, device)
        if device.type == "cuda":
            sdpa.enable(self.sdpa_backend)
            cfg = self.model.config
            precision = str(self.trainer.precision)
            dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
            sdpa.check_supported(self.sdpa_backend, cfg.n_head, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, dtype,
                                 device)
        if self._trainer is not None:
            seq_len = getattr(self.trainer.datamodule, "seq_len", None) or self.model.config.max_seq_len
            with self.trainer.precision_plugin.forward_context():
                self.attention_kernel = self._attention_kernel(torch.zeros(1, seq_len, dtype=torch.long, device=device))
        if self.compile:  # the loss was just set: its compiled form once per function, never twice
            compile_loss(self.model, self.fullgraph)
        if self._configured:  # configure_model runs again on a second fit/validate of this module
            return
        if self.compile:
            self.compile_watch = CompileWatch().start()
            compile_model(self.model, self.fullgraph)
        mesh = self.device_mesh  # set by ModelParallelStrategy (trainer=fsdp), None otherwise
        if mesh is not None:
            precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
            shard(self.model, mesh, mp_policy=mixed_precision_policy(precision))
        self._configured = True

    def log_compiles(self, step: int | None = None) -> None:
        """Each Dynamo compile since the last call: a first compile logged with the optimizer step
        it happened in (``step``; default the steps completed), a recompile (none expected after
        the first step of each kind: ``bnlit.speed.compile``) warned about with Dynamo's reason,
        except one for a new thread count (logged: ``thread_count_recompile``)."""
        for event in self.compile_watch.poll() if self.compile_watch is not None else ():
            if step is None:
                step = self.trainer.global_step if self._trainer is not None else 0
            if not event.recompile or thread_count_recompile(event):
                if self._trainer is None or self.trainer.is_global_zero:
                    log.info("%s", compile_line(event, step) + (" for the new thread count (callbacks.threads; "
                                                                "expected once per count)" if event.recompile else ""))
                continue
            message = recompile_warning(event, step)
            rank_zero_warn(message)
            log.warning("!!! %s", message)

    def on_train_start(self) -> None:
        if self.compile:
            compile_ahead.wait("train")  # the child compiling this run's graphs, if one was started
        restore_checkpointed_row(self.trainer, self._checkpointed_row)  # lost to a kill after the save?
        self._checkpointed_row = None
        self.fast_path = describe_fast_path(self.trainer, self)
        if self.trainer.is_global_zero:
            log.info("%s", self.fast_path)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def attention_mask(self, x: torch.Tensor):
        """The document mask of the windows ``x``, or None (causal) with masking off."""
        return document_masking.document_mask(x, EOS_ID) if self.document_masking else None

    def loss_for_batch(self, batch, model: nn.Module | None = None) -> torch.Tensor:
        """The training loss of one ``(x, y)`` batch, nothing logged: the model's own loss (in
        the compiled graph when compiled) with this run's document mask and ``loss_impl``.
        ``training_step`` and the gradient-flow arbiter's fast-path parity probe both call it, so
        the probe checks the loss that trains (docs/gradient-flow.md). ``model``
        (default ``self.model``) runs the same loss on another copy of the weights."""
        x, y = batch
        return (model or self.model)(x, y, mask=self.attention_mask(x))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        self._batch_step = self.global_step
        loss = self.loss_for_batch(batch)
        # no host read and no all-reduce on the steps nobody logs: the micro-batch losses add up
        # on the device and reach the loggers and the progress bar on logging steps only (global
        # step + 1 is Lightning's own test of ``log_every_n_steps`` during training_step)
        accumulate = self.trainer.accumulate_grad_batches
        first = batch_idx % accumulate == 0 or self._step_loss is None
        self._step_loss = loss.detach() if first else self._step_loss + loss.detach()
        every = self.trainer.log_every_n_steps
        if every and (self.global_step + 1) % every == 0:
            micro = batch_idx % accumulate + 1
            # averaged over ranks (one scalar all-reduce under DDP), so the curve is the global batch's loss
            self.log("train/loss", self._step_loss / micro, prog_bar=True, sync_dist=True)
            if self.trainer.lr_scheduler_configs:
                self.log("train/lr", self.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # the step this micro-batch trained in (the last one of a step ends after global_step counts it)
        self.log_compiles(self._batch_step)

    def _attention_kernel(self, x: torch.Tensor) -> str:
        """The attention kernel a training step on windows like ``x`` dispatches (call it under
        the precision plugin's autocast): PyTorch's own SDPA choice for the step's query/key
        shapes, dtype and mask, or flex attention for the CUDA document mask."""
        if self.document_masking and x.is_cuda:
            return "flex_attention" + (" (compiled)" if self.compile else " (eager: compile the model to fuse it)")
        cfg = self.model.config
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else \
            self.model.output.weight.dtype
        q = torch.empty(x.shape[0], cfg.n_head, x.shape[1], cfg.head_dim, dtype=dtype, device=x.device)
        k = torch.empty(x.shape[0], cfg.n_kv_heads, x.shape[1], cfg.head_dim, dtype=dtype, device=x.device)
        mask = self.attention_mask(x)
        if sdpa.kernel_fn(self.sdpa_backend, x.device) is sdpa.math_attention:
            return "sdpa:math"
        return "sdpa:" + sdpa.kernel_choice(q, k, k, mask)

    def on_fit_start(self) -> None:
        """The leakage probe (``bnlit.document_masking.leakage``), logged as
        ``document_masking/leakage``: with masking on, a run whose logits change after a document
        boundary when the text before it changes is refused before its first step."""
        if not self.document_masking:
            return
        value = document_masking.leakage_probe(self.model.config, EOS_ID, self.device)
        tolerance = 1e-4
        log_metrics(self.trainer, {"document_masking/leakage": value})
        if self.trainer.is_global_zero:
            log.info("document masking: leakage probe %.2e (max logit change after a boundary; tolerance %.0e)",
                     value, tolerance)
        if value > tolerance:
            raise BnlitError(f"document masking leaks: logits after a document boundary change by {value:.3g} when "
                             "the text before it changes; report this, or run with module.document_masking=false")

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x, y = batch
        # a short last batch padded to the micro-batch (rows whose targets count for nothing), so a
        # compiled model validates with the one graph of its shape (bnlit.speed.compile)
        loss = self.loss_for_batch(pad_rows(batch, getattr(self.trainer.datamodule, "batch_size", None)))
        names = getattr(self.trainer.datamodule, "val_languages", None) if self.trainer.datamodule else None
        name = names[dataloader_idx] if names else str(dataloader_idx)
        self.log(f"val/{name}_loss", loss, add_dataloader_idx=False, batch_size=x.shape[0])
        self._val_losses.append((loss.detach(), x.shape[0]))
        return loss

    def on_validation_start(self) -> None:
        if self.compile:
            compile_ahead.wait("eval")

    def on_validation_epoch_start(self) -> None:
        self._val_losses = []

    def on_validation_epoch_end(self) -> None:
        # every rank evaluates the same validation windows, so the mean needs no reduction
        if self._val_losses:
            losses = torch.stack([l for l, _ in self._val_losses])
            weights = torch.tensor([n for _, n in self._val_losses], device=losses.device, dtype=losses.dtype)
            self.log("val/loss", (losses * weights).sum() / weights.sum(), prog_bar=True)
        # One step convention for every metric: the optimizer steps completed when the value was
        # measured. Lightning logs an in-fit validation at its count of steps before the current
        # one (49 after 50 steps), while the twin, baselines and plots use trainer.global_step
        # (50); a logged "step" is the x value Lightning hands the loggers instead.
        self.log("step", float(self.global_step))
        self._val_losses = []

    def on_validation_end(self) -> None:
        self.log_compiles()  # validation's own, and the random twin's and multiple choice's before this hook
        # the "step" logged above is the loggers' x value only: left in callback_metrics it would
        # name the next checkpoints (ModelCheckpoint's {step}) after this validation's step
        self.trainer.callback_metrics.pop("step", None)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # bf16-mixed has no loss scaler, so the gradients are already true gradients and
            # clipping them before a fused optimizer's step is exact. Lightning's
            # MixedPrecision.clip_gradients refuses every optimizer that "handles unscaling"
            # (fused=True) whether or not a scaler exists; its base class clips without that check.
            # With fp16 (a scaler) the refusal stands: a fused step unscales after clipping.
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, GradClipAlgorithmType(gradient_clip_algorithm or "norm"))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # Lightning's default, the closure (forward, backward) marked for a profiler when one runs, so
        # the MFU alarm's trace does not count the step's matmuls as optimizer time (bnlit.speed.profiling)
        optimizer.step(closure=marked_closure(optimizer_closure))

    def configure_optimizers(self):
        wd = self.optimizer_factory.keywords.get("weight_decay", 0.0)
        optimizer = self.optimizer_factory(param_groups(self.model, wd))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        cfg = getattr(self.model, "config", None)
        if cfg is not None:
            checkpoint["model_config"] = cfg.to_dict()
        # the attention the weights were trained with: scripts/evaluate.py scores with the same
        checkpoint["document_masking"] = self.document_masking
        if self._trainer is not None and (row := checkpointed_row(self.trainer)) is not None:
            checkpoint["metrics_row"] = row  # Lightning logs it after the save: a resume restores it if lost

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._checkpointed_row = checkpoint.get("metrics_row")
