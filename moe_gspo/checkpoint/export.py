"""Export a training run's checkpoint as a Hugging Face folder that transformers and vLLM load.

    moe-gspo export runs/train_tiny_cpu --out hf/train_tiny_cpu [--step N] [--overwrite]
    path = export_run("runs/train_tiny_cpu", "hf/train_tiny_cpu", step=None)   # None: the newest checkpoint

The folder holds:
    config.json, model*.safetensors   the policy in the per-expert Qwen3-MoE layout (hf_io.write_hf_dir)
    generation_config.json            the bos / eos / pad ids the run sampled with, so that generation stops where
                                      its rollouts stopped; with the checkpoint's own tokenizer, model.init_from's
                                      generation_config.json extended by that tokenizer's ids
    tokenizer files                   when the run used model.init_from's tokenizer (its chat template included)
    moe_gspo_export.json              the run and step it came from (it also marks the folder as an export, which
                                      a later export may replace)

The checkpoint is read in one process at tp = ep = 1 whatever layout trained it: megatron's sharded checkpoints
reshard on load, so a TP or EP run exports the same tensors as a one-rank run. Everything is written into a temp
folder beside --out, fsynced, and renamed into place: --out is either the old folder or the whole new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from moe_gspo.config import ConfigError, UserError

MARKER = "moe_gspo_export.json"
FORMAT = "moe-gspo-export-v1"


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, overwrite: bool = False) -> Path:
    """Write checkpoint `step` (default: the newest complete one) of the run in `run_dir` as a Hugging Face folder
    at `out`; returns `out`. An existing `out` is replaced when it is an earlier export or empty, or with
    overwrite=True; otherwise UserError, as for a folder that is not a run or a step it does not hold."""
    from moe_gspo.config import ParallelConfig, load_config
    from moe_gspo.model.load import init_parallel, load_policy
    from moe_gspo.checkpoint.store import Checkpoints
    from moe_gspo.tasks.tokenizer import build_tokenizer

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("export runs in one process, whatever layout the run trained at: start it without torchrun")
    run, out = Path(run_dir), Path(out)
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run}: no config.yaml (not a `moe-gspo train` run directory)")
    ckpts = Checkpoints(run / "checkpoints")
    step = _pick_step(ckpts, step)
    _check_out(out, run, overwrite)
    cfg = load_config(run / "config.yaml")
    tok = build_tokenizer(cfg)
    one = ParallelConfig()  # one process, tp = ep = 1: the checkpoint reshards on load
    policy = load_policy(cfg, init_parallel(cfg, one), parallel=one)
    ckpts.load_weights(step, policy)
    config, tensors = policy.export_hf()
    gen = generation_config(cfg, tok)
    config.update({k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if gen.get(k) is not None})
    files = {**tokenizer_files(tok),
             "generation_config.json": json.dumps(gen, indent=2).encode(),
             MARKER: json.dumps({"format": FORMAT, "run": str(run.resolve()), "step": step,
                                 "tokenizer": "hf" if _is_hf(tok) else "char"}, indent=2).encode()}
    return _write(out, config, tensors, files)


def summary_lines(path: str | Path) -> list[str]:
    """What an export holds and how to load it, from its moe_gspo_export.json."""
    path = Path(path)
    info = json.loads((path / MARKER).read_text())
    lines = [f"exported step {info['step']} of {info['run']} to {path}",
             f"load it with: AutoModelForCausalLM.from_pretrained({str(path)!r})"]
    if info["tokenizer"] == "hf":
        lines.append(f"its tokenizer: AutoTokenizer.from_pretrained({str(path)!r})")
    else:
        lines.append("its tokenizer is the run's character tokenizer (moe_gspo.tasks.CharTokenizer: pad 0, bos 1, "
                     "eos 2); the folder holds no tokenizer files")
    return lines


# ---------------------------------------------------------------------------------------------------- the parts
def _is_hf(tok) -> bool:
    from moe_gspo.tasks.tokenizer import HFTokenizer

    return isinstance(tok, HFTokenizer)


def generation_config(cfg, tok) -> dict:
    """generation_config.json: bos / eos / pad of the tokenizer the run trained with. With the checkpoint's own
    tokenizer, model.init_from's generation_config.json (when it has one) is the base: its sampling defaults and
    eos list are kept, the tokenizer's eos added to the list when missing, bos and pad filled where unset."""
    # a tokenizer without bos (Qwen's) stands its eos in for bos inside this package; an export names no bos then
    has_bos = getattr(tok, "has_bos", True)
    ids = {"bos_token_id": tok.bos_id if has_bos else None, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    ids = {k: v for k, v in ids.items() if v is not None}
    src = Path(cfg.model.init_from) / "generation_config.json" if cfg.model.init_from else None
    if not _is_hf(tok) or src is None or not src.is_file():
        return ids
    try:
        base = json.loads(src.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{src}: unreadable ({type(e).__name__}: {e})") from None
    eos = base.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    if tok.eos_id not in eos:
        eos.append(tok.eos_id)
    base["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for k in ("bos_token_id", "pad_token_id"):
        if base.get(k) is None and k in ids:
            base[k] = ids[k]
    return base


def tokenizer_files(tok) -> dict[str, bytes]:
    """name -> bytes of the files transformers' save_pretrained writes for the run's HF tokenizer (tokenizer.json,
    tokenizer_config.json, the chat template, ...); none for the character tokenizer."""
    if not _is_hf(tok):
        return {}
    with tempfile.TemporaryDirectory(prefix="moe_gspo_tokenizer_") as d:
        tok.tok.save_pretrained(d)
        return {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}


def _pick_step(ckpts, step: int | None) -> int:
    """The checkpoint step to export: `step` when the run holds it, else the newest complete one."""
    have = ckpts.steps()
    if not have:
        raise UserError(f"{ckpts.root.parent}: no checkpoints in {ckpts.root} (train with train.checkpoint_every > 0)")
    if step is None:
        newest = ckpts.latest()  # verified; a broken newer one is reported and skipped
        if not newest:
            raise UserError(f"{ckpts.root}: no complete checkpoint (every one failed its check)")
        return newest
    if step not in have:
        raise UserError(f"--step {step}: {ckpts.root} holds no such checkpoint; its steps are "
                        f"{', '.join(map(str, sorted(have)))}")
    return step


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_out(out: Path, run: Path, overwrite: bool) -> None:
    """Refuse an --out that would replace something other than an earlier export or an empty folder (unless
    overwrite), the run itself, or a place that cannot be written."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"--out {out}: exists and is not a folder")
        if out.resolve() == run.resolve() or out.resolve() in run.resolve().parents:
            raise UserError(f"--out {out}: would replace the run it exports ({run})")
        if not (out / MARKER).is_file() and any(out.iterdir()) and not overwrite:
            raise UserError(f"--out {out}: exists, is not empty and is not an earlier export (no {MARKER}); "
                            f"choose another folder or pass --overwrite to replace it")
    base = _nearest_existing(out.parent)
    if not base.is_dir():
        raise UserError(f"--out {out}: {base} is not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: {base} is not writable")


def _write(out: Path, config: dict, tensors: dict, files: dict[str, bytes]) -> Path:
    """config.json + safetensors (hf_io.write_hf_dir) and `files` into a temp folder beside `out`, each fsynced,
    then renamed to `out` (an existing `out` is moved aside first and removed after)."""
    from moe_gspo.model.hf_io import fsync_dir, usual_modes, write_hf_dir

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        folder = write_hf_dir(staging / "hf", config, tensors)
        for name, data in files.items():
            with open(folder / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        usual_modes(folder)
        fsync_dir(folder)
        if out.exists():
            old = staging / "old"
            os.rename(out, old)
            try:
                os.rename(folder, out)
            except OSError:
                os.rename(old, out)  # the earlier folder goes back where it was
                raise
        else:
            os.rename(folder, out)
        fsync_dir(out.parent)
    except OSError as e:
        raise UserError(f"--out {out}: writing failed ({e.strerror or e})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
