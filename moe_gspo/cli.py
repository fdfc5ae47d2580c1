"""`moe-gspo`: the one command line of the package.

    moe-gspo info
    moe-gspo train --config configs/train_tiny_cpu.yaml [--resume | --overwrite] [--out DIR] [a.b=v ...]
    moe-gspo train-lm --config configs/tiny_cpu.yaml [a.b=v ...]
    moe-gspo rollout (--config C | --from RUN_DIR) --out FILE.jsonl [--num-prompts N] [--seed S] [a.b=v ...]
    moe-gspo compare --config configs/compare_tiny_cpu.yaml --out DIR [--only grpo,gspo] [--seeds N] [--jobs K]
                     [--resume | --overwrite] [a.b=v ...]
    moe-gspo study volatility --config configs/studies/volatility_cpu.yaml --out DIR [--jobs K] [--overwrite]
                              [a.b=v ...]
    moe-gspo report volatility RUN_DIR [RUN_DIR ...] [--out FILE.html]
    moe-gspo report compare DIR
    moe-gspo export RUN_DIR --out DIR [--step N] [--overwrite]   # a checkpoint as a Hugging Face folder
    moe-gspo launch [torchrun options] -- COMMAND [args]          # COMMAND on torchrun's ranks, errors in one line
    torchrun --nproc-per-node 2 -m moe_gspo.cli train --config C parallel.ep=2      # any command, distributed

An error the user can cause (a config field, a file, a checkpoint, a world size) ends in one line on stderr,
`moe-gspo <command>: error: ...` (with the rank under torchrun; one line for the whole job under scripts/launch.sh,
i.e. `moe-gspo launch`), and exit code 2; a bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from moe_gspo.config import UserError
from moe_gspo.config.checks import error_line
from moe_gspo.model.families import every
from moe_gspo.parallel import launch as launcher


def _rank() -> int | None:
    """This process's rank in a multi-rank job, None alone."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None




def _leave_process_group() -> None:
    """Destroy every process group of a multi-rank job before the interpreter finalizes. Left alive, gloo's worker
    threads can still hold work items at exit, and tearing those down then aborts the process (SIGABRT,
    "terminate called without an active exception") after the command has already succeeded; torchrun counts
    that rank as failed and the other agents wait out their exit barrier. A one-rank group (in-process callers,
    the tests) is kept so that repeated calls reuse it."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="a.b=value", help="config overrides, applied after the YAML")


# ---------------------------------------------------------------------------------------------------- commands
def _vllm_row() -> str:
    """vLLM's version and where the engine's R3 routing comes from (vLLM's capture on CUDA, router hooks on CPU)."""
    from moe_gspo.rollout.vllm.families import vllm_info

    info = vllm_info()
    if "routing" not in info:
        return info["version"]
    how = "native capture" if info["routing"] == "native" else "router capture hooks"
    return f"{info['version']}; R3 routing: {info['routing']} ({how})"


def _info(_args) -> int:
    import platform

    import torch

    import moe_gspo
    from moe_gspo.model.families import names

    def version(mod):
        try:
            m = importlib.import_module(mod)
            return getattr(m, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - report any import failure as unavailable
            return f"not available ({type(e).__name__})"

    rows = [
        ("moe-gspo", moe_gspo.__version__), ("python", platform.python_version()), ("torch", torch.__version__),
        ("megatron-core", version("megatron.core")), ("transformers", version("transformers")),
        ("safetensors", version("safetensors")),
        ("CUDA", f"yes ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "no"),
        ("Transformer Engine", version("transformer_engine")), ("Triton", version("triton")),
        ("SGLang", version("sglang")), ("vLLM", _vllm_row()), ("math-verify", version("math_verify")),
        ("CPU threads", str(torch.get_num_threads())),
        ("layer spec (model.spec)", _spec_line()),
        ("model families", f"{', '.join(names())} (model.family; a checkpoint's config.json sets it)"),
    ]
    from rich.console import Console
    from rich.table import Table

    t = Table(title="moe-gspo environment")
    t.add_column("component")
    t.add_column("version / availability")
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    return 0


def _spec_line() -> str:
    """Which decoder layer spec a run gets and why: 'local' unless a config says model.spec=te, which needs TE on
    CUDA."""
    from moe_gspo.model.spec import te_missing

    missing = te_missing()
    te = "model.spec=te can run here" if missing is None else f"model.spec=te cannot run here: {missing}"
    return f"local by default (a config's model.spec selects; an installed TE changes nothing); {te}"


def _train(args) -> int:
    from moe_gspo.config import load_config
    from moe_gspo.train.loop import train
    from moe_gspo.train.separate import split_and_serve

    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        return _print_config(cfg)
    if _rank() is not None and not launcher.under_launcher():  # torchrun's SIGTERM after another rank died: one line
        from moe_gspo.checkpoint.run_lock import resume_hint

        run_dir = Path(args.out or cfg.train.out_dir)
        launcher.stop_line_on_sigterm("train", _rank(), lambda: resume_hint(run_dir))
    roles, served = split_and_serve(cfg)  # rollout.placement=separate: the job's last engine_ranks ranks only sample
    if not served:
        train(cfg, resume=args.resume, overwrite=args.overwrite, run_dir=args.out, roles=roles)
    return 0


def _print_config(cfg) -> int:
    """The merged config (the YAML, the overrides, a checkpoint's architecture) as YAML, as a run records it."""
    import yaml

    from moe_gspo.config import to_dict

    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _train_lm(args) -> int:
    from moe_gspo.config import load_config
    from moe_gspo.commands.lm import train_lm

    train_lm(load_config(args.config, args.overrides))
    return 0


def _rollout(args) -> int:
    from moe_gspo.commands.sample import rollout_command

    path, metrics = rollout_command(args.config, args.run_dir, args.overrides, args.num_prompts, args.out, args.seed)
    print(" ".join(f"{k}={v:.3g}" for k, v in metrics.items()))
    print(f"wrote {path}")
    return 0


def _compare(args) -> int:
    from moe_gspo.experiments.compare import cold_start_one, run_comparison, run_one
    from moe_gspo.report.compare_data import summary_lines

    if args.cold_start_to:  # the processes a --jobs comparison starts: one cold start, or one run
        cold_start_one(args.config, args.cold_start_to)
        return 0
    if args.run_one:
        run_one(args.config, args.out, args.run_one)
        return 0
    report = run_comparison(args.config, args.out, args.overrides, only=args.only.split(",") if args.only else None,
                            overwrite=args.overwrite, seeds=args.seeds, jobs=args.jobs, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":  # the answer first, then where the figures are
        print("\n".join(summary_lines(report.parent)))
        print(f"report: {report}")
    return 0


def _study_volatility(args) -> int:
    from moe_gspo.experiments.volatility import run_volatility_study

    print(run_volatility_study(args.config, args.out, args.overrides, overwrite=args.overwrite, jobs=args.jobs))
    return 0


def _report_volatility(args) -> int:
    from moe_gspo.report.volatility import write_volatility_report

    print(write_volatility_report(args.run_dirs, args.out))
    return 0


def _report_compare(args) -> int:
    from moe_gspo.report.compare import write_compare_report

    d = Path(args.dir)
    meta = d / "compare.json"
    if not meta.is_file():
        raise UserError(f"{meta}: not found (DIR must be the --out of a `moe-gspo compare` run)")
    info = json.loads(meta.read_text())
    print(write_compare_report(d, list(info["variants"]), info.get("wall_seconds"),
                               cold_start_seconds=info.get("cold_start_seconds")))
    return 0


PREFLIGHT = ("train", "train-lm", "rollout")
"""The commands whose --config is a run config that load_config reads (compare and study read their own)."""


def _preflight(command: list[str]):
    """Parse a moe-gspo command line (argparse's usage error exits 2 here) and load a run config once, raising its
    UserError before any rank starts. For a `train` command, returns run_lock.resume_hint of its run directory as a
    function of the command that resumes it; else None."""
    from moe_gspo.config import load_config
    from moe_gspo.checkpoint.run_lock import resume_hint

    args = build_parser().parse_args(command)
    if args.command in PREFLIGHT and getattr(args, "config", None):
        cfg = load_config(args.config, args.overrides)
        if args.command != "train-lm":
            from moe_gspo.train.data import check_names

            check_names(cfg)  # the engine's capabilities; the world size is checked on the ranks
        if args.command == "train":
            run_dir = Path(args.out or cfg.train.out_dir)
            return lambda resume: resume_hint(run_dir, resume)
    return None


LAUNCH_HELP = """usage: moe-gspo launch [torchrun options] -- COMMAND [args]

Run a moe-gspo COMMAND (train, train-lm, compare, ...) on torchrun's ranks, in this process's torchrun. The options
before `--` are torchrun's (--nproc-per-node, --nnodes, --node-rank, --master-addr, --master-port,
--max-restarts, ...). A user error on any rank ends the job in one line naming that rank, exit code 2.

  moe-gspo launch --nproc-per-node 2 -- train --config configs/train_tiny_cpu.yaml parallel.tp=2
  scripts/launch.sh sets the torchrun options from NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE."""


def _launch(args) -> int:
    from moe_gspo.parallel.launch import launch

    rest = list(args.rest)
    if rest[: rest.index("--") if "--" in rest else len(rest)] in (["-h"], ["--help"]):
        print(LAUNCH_HELP)
        return 0
    if "--" not in rest or rest.index("--") == len(rest) - 1:
        raise UserError("launch needs a command after `--`: moe-gspo launch [torchrun options] -- COMMAND [args]")
    cut = rest.index("--")
    return launch(rest[:cut], rest[cut + 1:], _preflight)


def _export(args) -> int:
    from moe_gspo.checkpoint.export import export_run, summary_lines

    print("\n".join(summary_lines(export_run(args.run_dir, args.out, step=args.step, overwrite=args.overwrite))))
    return 0


def _upcycle(args) -> int:
    from moe_gspo.model.upcycle import UpcycleSpec, upcycle

    spec = UpcycleSpec(num_experts=args.experts, top_k=args.top_k, family=args.family, drop_rate=args.drop_rate,
                       router_std=args.router_std, seed=args.seed, dtype=args.dtype)
    r = upcycle(args.src, args.out, spec, save_dense=args.save_dense, overwrite=args.overwrite)
    print(f"upcycled {r['source_model_type']} {r['source']} -> {r['family']} {args.out}: {r['num_experts']} experts, "
          f"top-{r['top_k']}, drop rate {r['drop_rate']}, router N(0, {r['router_std']}), {r['dtype']}")
    return 0


# ------------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gspo", description=__doc__.splitlines()[0],
                                epilog="moe-gspo COMMAND --help describes each command.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="versions and available backends").set_defaults(func=_info)

    t = sub.add_parser("train", help="RL-train the policy (GRPO, GSPO, GSPO-token, ...)")
    t.add_argument("--config", required=True, help="YAML config (configs/train_tiny_cpu.yaml)")
    t.add_argument("--resume", action="store_true", help="continue the run directory's newest complete checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace a previous run in the run directory")
    t.add_argument("--out", default=None, help="run directory (default: train.out_dir)")
    t.add_argument("--print-config", action="store_true",
                   help="print the merged config (YAML, overrides, the checkpoint's architecture) and exit")
    _overrides(t)
    t.set_defaults(func=_train)

    lm = sub.add_parser("train-lm", help="plain next-token training of the policy (a smoke test of the stack)")
    lm.add_argument("--config", required=True, help="YAML config (configs/tiny_cpu.yaml)")
    _overrides(lm)
    lm.set_defaults(func=_train_lm)

    r = sub.add_parser("rollout", help="sample, score and log a batch of responses")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML config: sample from a freshly built (or model.init_from) policy")
    src.add_argument("--from", dest="run_dir", help="a training run directory: its config and newest checkpoint")
    r.add_argument("--out", required=True, help="JSONL file to write, one line per response")
    r.add_argument("--num-prompts", type=int, default=4, help="prompts to sample (each gets rollout.group_size)")
    r.add_argument("--seed", type=int, default=None, help="sampling seed (default: train.seed)")
    _overrides(r)
    r.set_defaults(func=_rollout)

    c = sub.add_parser("compare", help="variants (GRPO, +R2, +R3, GSPO, ...) side by side, with a report")
    c.add_argument("--config", required=True, help="YAML config with a `compare:` section")
    c.add_argument("--out", required=True, help="output directory: DIR/<variant>/seed_<s>/ and DIR/report.html")
    c.add_argument("--only", default=None, help="comma-separated subset of the variants to run")
    c.add_argument("--overwrite", action="store_true", help="replace a previous comparison in DIR")
    c.add_argument("--resume", action="store_true",
                   help="keep the cold starts and runs DIR already finished under this config and run the rest "
                        "(complete an interrupted comparison, or add seeds with a larger --seeds)")
    c.add_argument("--seeds", type=int, default=None,
                   help="runs per variant with train.seed + 0..N-1, paired across variants (default: compare.seeds)")
    c.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, each in its own process with OMP_NUM_THREADS = cores // jobs "
                        "(default: compare.jobs, else 1)")
    c.add_argument("--cold-start-to", default=None, metavar="WEIGHTS", help=argparse.SUPPRESS)  # --jobs processes
    c.add_argument("--run-one", default=None, metavar="WEIGHTS", help=argparse.SUPPRESS)
    _overrides(c)
    c.set_defaults(func=_compare)

    st = sub.add_parser("study", help="grids of training runs measuring one effect, with a report")
    studies = st.add_subparsers(dest="kind", required=True, metavar="KIND")
    sv = studies.add_parser("volatility", help="expert flip rate vs depth, learning rate and minibatches")
    sv.add_argument("--config", required=True, help="YAML config with a `study:` section "
                                                    "(configs/studies/volatility_cpu.yaml)")
    sv.add_argument("--out", required=True, help="output directory: DIR/<point>/seed_<s>/ and DIR/report.html")
    sv.add_argument("--overwrite", action="store_true", help="replace a previous study in DIR")
    sv.add_argument("--jobs", type=int, default=None,
                    help="cold-start groups at a time, each in its own process with cores // jobs threads "
                         "(default: study.jobs)")
    _overrides(sv)
    sv.set_defaults(func=_study_volatility)

    rep = sub.add_parser("report", help="HTML reports from run directories")
    kinds = rep.add_subparsers(dest="kind", required=True, metavar="KIND")
    v = kinds.add_parser("volatility", help="expert-flip / routing volatility of one or more runs")
    v.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    v.add_argument("--out", default=None, help="HTML path (default: FIRST_RUN_DIR/volatility.html)")
    v.set_defaults(func=_report_volatility)
    rc = kinds.add_parser("compare", help="(re)write DIR/report.html of a `moe-gspo compare` run")
    rc.add_argument("dir", metavar="DIR")
    rc.set_defaults(func=_report_compare)

    ex = sub.add_parser("export", help="a run's checkpoint as a Hugging Face folder (transformers, vLLM)")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (config.yaml, checkpoints/)")
    ex.add_argument("--out", required=True, help="folder to write: config.json, safetensors, generation_config.json "
                                                 "and the tokenizer when the run used a checkpoint's own")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint step to export (default: the newest)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace --out even when it is not empty and not an earlier export")
    ex.set_defaults(func=_export)

    up = sub.add_parser("upcycle", help="a dense HF checkpoint or GGUF file as an MoE checkpoint (each expert a "
                                        "copy of the dense MLP)")
    up.add_argument("src", metavar="SRC", help="a dense Llama, Mistral, Qwen2 or Qwen3 checkpoint folder, or a .gguf "
                                               "file (needs the gguf package)")
    up.add_argument("--out", required=True, help="folder to write: config.json, safetensors, tokenizer, chat template, "
                                                 "generation_config.json, upcycle.json")
    up.add_argument("--experts", type=int, default=4, help="experts per layer (default 4)")
    up.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    up.add_argument("--family", default=None, choices=sorted(f.name for f in every() if f.upcycles_from),
                    help="the MoE family (default: mixtral for Llama and Mistral, qwen2_moe for Qwen2 with a shared "
                         "expert, qwen3_moe for Qwen3)")
    up.add_argument("--drop-rate", type=float, default=0.0,
                    help="Drop-Upcycling: the fraction of each expert's neurons re-initialized (default 0: the MoE "
                         "computes the dense model's function exactly)")
    up.add_argument("--router-std", type=float, default=None,
                    help="std of the router's N(0, std) initialization (default: the source's initializer_range)")
    up.add_argument("--seed", type=int, default=0, help="seed of the router and of Drop-Upcycling's draws")
    up.add_argument("--dtype", default=None, help="dtype to save (default: the source's; GGUF: float32)")
    up.add_argument("--save-dense", default=None, metavar="DIR",
                    help="also write the dense model as a plain HF folder (a GGUF file's dequantized weights)")
    up.add_argument("--overwrite", action="store_true", help="replace --out (and --save-dense) when not empty")
    up.set_defaults(func=_upcycle)

    la = sub.add_parser("launch", help="COMMAND on torchrun's ranks (scripts/launch.sh); a user error in one line",
                        add_help=False, prefix_chars="\0")
    la.add_argument("rest", nargs=argparse.REMAINDER, metavar="[torchrun options] -- COMMAND [args]")
    la.set_defaults(func=_launch)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `a.b=value` overrides taken wherever they stand (after an option too, as in
    `train --config X a.b=1 --out D c.d=2`), in the order given."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "launch":  # launch hands everything to torchrun and the command
        args.rest = list(args.rest) + extra
        extra = []
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")  # argparse's own words, exit 2
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:  # anything else is a bug here and keeps its traceback
        from moe_gspo.parallel.launch import report_user_error

        if getattr(e, "detail", None):
            print(e.detail.rstrip("\n"), file=sys.stderr, flush=True)
        if not report_user_error(args.command, str(e)):  # under `moe-gspo launch` the launcher prints it, once
            print(error_line(args.command, str(e), _rank()), file=sys.stderr, flush=True)
        return 2
    except Exception:
        from moe_gspo.parallel.launch import another_rank_reported

        if another_rank_reported():  # a consequence of a peer's user error (a collective it left): that one line
            return 1
        if _rank() is not None and launcher.peer_lost(sys.exc_info()[1]):
            launcher.wait_for_stop()  # a peer died: torchrun stops this rank, and the launcher or the handler says why
        raise
    finally:
        _leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
