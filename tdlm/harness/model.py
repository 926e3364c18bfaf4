"""The ``tdlm`` model of lm-evaluation-harness: ``generate_until`` served by :func:`tdlm.decode`.

``--model_args`` (fields of :class:`HarnessConfig`)::

    pretrained=GSAI-ML/LLaDA-8B-Instruct,adapter=me/tdlm-llada-16d,policy=tdlm,threshold=0.9,gen_length=256,block_size=32

* ``pretrained=`` names the backbone as in the harness's own models (so ``--output_path`` gets a folder named after
  it); ``backbone=`` is accepted as an alias. Every field is checked before a weight is loaded: an unknown key gets a
  "did you mean", ranges are enforced (``threshold`` in [0, 1], ``entropy_threshold`` > 0, ...), one line each;

* requests are decoded ``--batch_size`` rows at a time by the decode engine, a finished row taking the next request
  (left-padded per prompt bucket; each row counts its own NFE, so a batch gives the tokens of per-request runs),
  longest prompts first;
* chat template: with ``--apply_chat_template`` the harness renders the conversation through the backbone's template
  (:meth:`apply_chat_template`); otherwise ``chat=true`` (default, as tdlm's own evaluator) sends each context as one
  user message through the template, ``chat=false`` feeds the raw text;
* stop sequences: the text is cut at the backbone's stop tokens (EOS, end of turn) and then at the first of the
  request's ``until`` strings. A diffusion canvas is decoded whole, so they cut the answer rather than end decoding
  early (``stop_at_eos=true`` ends a request once its EOS is committed). ``gen_length`` is the canvas: a request's
  ``max_gen_toks`` does not change it. Sampling (``do_sample=true``, ``temperature > 0``) is refused: the policies
  are greedy;
* NFE: every request's denoiser evaluations are counted. On the shipped ``tdlm_*`` tasks it is a metric, ``nfe``
  (mean, with its standard error, in ``results`` and the printed table: each request's count is kept under its
  document's (task, id) in :data:`NFE_BY_DOC` and read back by the task's ``process_results``); the mean per task
  (and NFE-per-token, seconds) is also logged at the end of each ``generate_until`` call and returned in
  ``results["config"]["tdlm"]`` (``get_model_info``), with the device the model really ran on;
* ``loglikelihood`` / ``loglikelihood_rolling``: refused with one line. A masked-diffusion model has no exact
  left-to-right likelihood (LLaDA estimates a bound by Monte-Carlo masking), and a TDLM adapter conditions on the
  history of its own denoising steps, which scoring a fixed continuation does not have.
"""

from __future__ import annotations

import difflib
import logging
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields, replace

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from tdlm.config import from_dict
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError

log = logging.getLogger("lm_eval.models.tdlm")  # under the harness's own logger (its handler, its level)

# (task, document id) -> denoiser evaluations of that request, read by tdlm/harness/tasks/utils.py:process_results.
# The harness hands a task's process_results only the document and the response text, so the model leaves its count
# here; one process serves both (the harness scores in the process that generated).
NFE_BY_DOC: dict[tuple[str, str], int] = {}


@dataclass
class HarnessConfig:
    """``--model_args`` of the ``tdlm`` model. The decode settings are its ``decode`` section
    (:class:`tdlm.decoding.config.DecodeSettings`, one check: :meth:`DecodeSettings.validate`); lm-eval's
    ``--model_args`` is a flat ``key=value`` list, so a key naming one of that section's fields (``policy=``,
    ``threshold=``, ``storage=`` ...) sets it there (``decode.policy=`` too), and lm-eval's ``--batch_size`` is its
    ``batch_size``. ``policy`` unset: tdlm with an adapter, else threshold."""

    pretrained: str  # the backbone: preset / shipped name, checkpoint folder, or a Hub id in the local HF cache
    adapter: str | None = None  # adapter folder or Hub repo id (policy tdlm)
    decode: DecodeSettings = field(default_factory=DecodeSettings)  # policy, tau, gen length, block, cache ...
    chat: bool = True  # wrap a raw context as a user message through the chat template
    allow_other_backbone: bool = False
    revision: str | None = None  # Hub revision of the adapter

    def check(self) -> HarnessConfig:
        """The checks that need no file, one line each, before anything is loaded."""
        policy = self.decode.policy
        if policy == "tdlm" and not self.adapter:
            raise TDLMError("--model_args: policy=tdlm needs adapter=<folder or Hub repo id>")
        if self.adapter and policy != "tdlm":
            raise TDLMError(f"--model_args: adapter= is used by policy=tdlm only; policy is {policy}")
        try:
            self.decode.validate()
        except TDLMError as e:
            raise TDLMError(f"--model_args: {e}") from None
        return self

    def check_adapter_history(self, folder: str | os.PathLike) -> None:
        """With ``history`` unset the adapter decodes its own: checked against the section (``storage``) from its
        config file, before the backbone is loaded."""
        if self.decode.history is None and self.decode.policy == "tdlm":
            from tdlm.temporal.adapter_files import trained_history

            try:
                replace(self.decode, history=str(trained_history(folder))).validate()
            except TDLMError as e:
                raise TDLMError(f"--model_args adapter={self.adapter}: {e}") from None


_ALIASES = {"backbone": "pretrained"}


def parse_model_args(args: dict, batch_size: int = 1) -> HarnessConfig:
    """``--model_args`` as a dict (and lm-eval's ``--batch_size``) -> :class:`HarnessConfig`; ``backbone=`` is an
    alias of ``pretrained=``; a key naming a decode field goes into the ``decode`` section; an unknown key names its
    nearest valid key."""
    args = dict(args)
    for alias, name in _ALIASES.items():
        if alias in args:
            if name in args and args[name] is not None:
                raise TDLMError(f"--model_args: give the backbone once (pretrained= or its alias {alias}=, not both)")
            args[name] = args.pop(alias)
    if args.get("pretrained") in (None, ""):
        raise TDLMError("--model_args: pretrained=<backbone> is required (a preset such as tiny-multi, a checkpoint "
                        "folder or a Hub id)")
    own = [f.name for f in fields(HarnessConfig) if f.name != "decode"]
    section = [f.name for f in fields(DecodeSettings) if f.name != "batch_size"]  # batch: lm-eval's --batch_size
    valid = own + section + list(_ALIASES)
    decode: dict = {"batch_size": batch_size}
    for key in list(args):
        name = key.removeprefix("decode.")
        if name in section:
            decode[name] = args.pop(key)
        elif key not in valid:
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TDLMError(f"--model_args: unknown key {key!r}{hint} (valid: {', '.join(valid)})")
    if decode.get("policy") is None:
        decode["policy"] = "tdlm" if args.get("adapter") else "threshold"
    args["pretrained"] = str(args["pretrained"])
    return from_dict(HarnessConfig, {**args, "decode": decode}, "--model_args").check()


def _batch_size(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        return int(value)
    raise TDLMError(f"--batch_size {value!r}: the tdlm model needs a positive integer (no 'auto')")


@register_model("tdlm")
class TDLMHarnessLM(LM):
    """A backbone (and TDLM adapter) decoded by :func:`tdlm.decode`; see the module docstring."""

    def __init__(self, batch_size: int | str = 1, max_batch_size: int | None = None, device: str | None = None,
                 **model_args) -> None:
        super().__init__()
        import torch

        from tdlm.data.tokenizer import load_tokenizer, stop_token_ids
        from tdlm.models.loading import load_backbone
        from tdlm.temporal.model import TDLM

        # every value checked (HarnessConfig.check); the section is what decode() receives, as it is
        self.config = parse_model_args(model_args, _batch_size(batch_size))
        c = self.config
        policy = c.decode.policy
        self.decode_config = c.decode
        self.batch_size_per_call = c.decode.batch_size
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:  # the harness's default is cuda:0; as its HF model does, fall back to the CPU
                log.warning("--device %s: no CUDA device here; decoding on the CPU", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        adapter = c.adapter
        if policy == "tdlm" and c.decode.storage != "dynamic":  # the adapter's own history, before the backbone loads
            from tdlm.temporal.adapter_files import resolve_adapter

            adapter = resolve_adapter(c.adapter, c.revision)
            c.check_adapter_history(adapter)
        bb = load_backbone(c.pretrained, dtype=c.decode.dtype, device=self._device)
        self.model = bb
        if policy == "tdlm":
            self.model = TDLM.from_pretrained(bb, adapter, history=c.decode.history, revision=c.revision,
                                              allow_other_backbone=c.allow_other_backbone)
        self.tokenizer = load_tokenizer(c.pretrained)
        self.stop_ids = stop_token_ids(self.tokenizer, bb.eos_token_id)
        self._harness_chat = False  # set once the harness renders contexts through apply_chat_template
        self._warned: set[str] = set()
        self.stats: dict[str, list[tuple[int, float, int]]] = defaultdict(list)  # task -> (nfe, seconds, tokens)

    # -- what the harness reads --------------------------------------------------------------------
    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.config.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self._harness_chat = True
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict:
        return {"tdlm": {**asdict(self.config), "policy": self.decode_config.policy, "device": str(self._device),
                         "batch_size": self.batch_size_per_call, "decode_stats": self.decode_stats()}}

    def decode_stats(self) -> dict:
        """Per task: requests, mean NFE, mean seconds, response tokens revealed per NFE; plus ``all``."""
        out = {}
        groups = dict(self.stats)
        if groups:
            groups["all"] = [s for v in self.stats.values() for s in v]
        for task, rows in groups.items():
            nfe = [r[0] for r in rows]
            out[task] = {"requests": len(rows), "nfe_mean": statistics.fmean(nfe),
                         "seconds_mean": statistics.fmean(r[1] for r in rows),
                         "tokens_per_nfe": sum(r[2] for r in rows) / max(1, sum(nfe))}  # fmt: skip
        return out

    # -- requests ----------------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list:
        raise TDLMError("the tdlm model serves generate_until tasks only: a masked-diffusion model has no exact "
                        "left-to-right log-likelihood (and a TDLM adapter conditions on its own denoising history); "
                        "choose a generate_until task (e.g. tdlm_gsm8k, gsm8k_cot_zeroshot)")

    def loglikelihood_rolling(self, requests) -> list:
        return self.loglikelihood(requests)

    def _encode(self, context: str) -> list[int]:
        from tdlm.data.tokenizer import encode_prompts

        if self._harness_chat:  # already rendered by the template: its special tokens are in the text
            return [int(i) for i in self.tokenizer(context, add_special_tokens=False)["input_ids"]]
        return encode_prompts(self.tokenizer, [context], chat=self.config.chat)[0]

    def _check_kwargs(self, task: str, kw: dict) -> list[str]:
        if kw.get("do_sample") or float(kw.get("temperature") or 0.0) > 0.0:
            raise TDLMError(f"task {task}: asks for sampling (do_sample={kw.get('do_sample')}, temperature="
                            f"{kw.get('temperature')}); tdlm decodes greedily: pass --gen_kwargs do_sample=false,"
                            f"temperature=0")
        if "max_gen_toks" in kw and kw["max_gen_toks"] != self.config.decode.gen_length and task not in self._warned:
            self._warned.add(task)
            log.warning("task %s: max_gen_toks=%s is not used; the canvas is gen_length=%d tokens", task,
                        kw["max_gen_toks"], self.config.decode.gen_length)
        until = kw.get("until") or []
        return [until] if isinstance(until, str) else [u for u in until if u]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        from tdlm.decoding import decode

        items = []
        for i, req in enumerate(requests):
            context, kw = req.args[0], dict(req.args[1] or {})
            task = req.task_name or "?"
            items.append((i, self._encode(context), self._check_kwargs(task, kw), task, req))
        items.sort(key=lambda it: -len(it[1]))  # similar lengths share a batch (less padding)
        out: list[str | None] = [None] * len(requests)
        t0 = time.perf_counter()
        bs = self.batch_size_per_call
        with tqdm(total=len(items), desc=f"tdlm[{self.decode_config.policy}]", unit="req",
                  disable=disable_tqdm or self.rank != 0) as bar:  # fmt: skip

            def finished(k: int, r) -> None:  # the engine hands each request over as it finishes
                i, _ids, until, task, req = items[k]
                text = r.text
                for stop in until:
                    text = text.split(stop, 1)[0]
                out[i] = text
                self.stats[task].append((r.nfe, r.seconds, len(r.tokens)))
                doc = req.doc if isinstance(req.doc, dict) else {}
                if "task" in doc and "id" in doc:
                    NFE_BY_DOC[(str(doc["task"]), str(doc["id"]))] = int(r.nfe)
                self.cache_hook.add_partial("generate_until", req.args, text)
                bar.update(1)

            # one engine run: a finished row takes the next request (refill), batch_size rows at a time
            decode(self.model, [it[1] for it in items], self.decode_config, tokenizer=self.tokenizer,
                   stop_ids=self.stop_ids, batch_size=bs, on_result=finished)  # fmt: skip
        for task, st in self.decode_stats().items():
            log.info("tdlm %s: %d requests, mean NFE %.2f, %.3f s/request, %.2f tokens/NFE (%.0f s this call)", task,
                     st["requests"], st["nfe_mean"], st["seconds_mean"], st["tokens_per_nfe"], time.perf_counter() - t0)
        return out  # type: ignore[return-value]
