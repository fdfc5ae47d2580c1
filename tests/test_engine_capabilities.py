"""What each rollout engine can do is declared on its class and checked once, before anything is built
(moe_gspo.rollout.check_engine): the trainer and the config ask the declarations, never an engine's name."""

import ast

import pytest
from helpers import ROOT, tiny_cfg

from moe_gspo.config import ConfigError
from moe_gspo.rollout import ENGINES, RolloutEngine, check_engine
from moe_gspo.rollout.base import replicas


class Toy(RolloutEngine):
    """An engine that declares nothing: one rank, no sleep, colocated only, one family."""

    families = ("mixtral",)
    checked = 0

    def generate(self, prompts, n_per_prompt=1, sampling=None):
        raise NotImplementedError

    def update_weights(self, weights):
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg):
        cls.checked += 1


class ToyAble(Toy):
    tensor_parallel = can_sleep = runs_separate = True
    families = None


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(ENGINES, "toy", Toy)
    monkeypatch.setitem(ENGINES, "toy_able", ToyAble)
    Toy.checked = ToyAble.checked = 0


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.engine_tp=2"], "rollout.engine_tp=2 with rollout.engine=toy: it runs on one rank; the tensor-parallel "
                              "engines are toy_able, vllm"),
    (["rollout.engine_sleep=true"], "rollout.engine_sleep=true with rollout.engine=toy: it has no sleep mode; the "
                                    "engines with one are toy_able, vllm"),
    (["rollout.placement=separate", "rollout.engine_ranks=1"],
     "rollout.placement=separate with rollout.engine=toy: it does not run on ranks of its own; the engines that do "
     "are hf, hf_static, toy_able, vllm"),
    ([], "rollout.engine=toy serves model.family in ['mixtral'] only; for model.family='qwen3_moe' use "
         "rollout.engine=hf or hf_static or toy_able"),
])
def test_an_engine_is_refused_what_its_class_does_not_declare(toys, overrides, needle):
    cfg = tiny_cfg("rollout.engine=toy", *overrides)
    with pytest.raises(ConfigError) as e:
        check_engine(cfg)
    assert str(e.value) == needle
    assert Toy.checked == 0  # the declarations are checked before the engine's own check
    able = tiny_cfg("rollout.engine=toy_able", *overrides)
    check_engine(able)
    assert ToyAble.checked == 1


def test_sleep_needs_the_colocated_placement_whatever_the_engine(toys):
    cfg = tiny_cfg("rollout.engine=toy_able", "rollout.engine_sleep=true", "rollout.placement=separate",
                   "rollout.engine_ranks=1")
    with pytest.raises(ConfigError, match=r"^rollout.engine_sleep=true needs rollout.placement=colocated \(got "
                                          r"'separate'\)"):
        check_engine(cfg)


def test_the_world_must_hold_whole_colocated_engines(toys):
    cfg = tiny_cfg("rollout.engine=toy_able", "rollout.engine_tp=2")
    check_engine(cfg)  # world unknown: not checked
    check_engine(cfg, world=4)
    with pytest.raises(ConfigError, match=r"^rollout.engine_tp=2 does not divide the world size 3$"):
        check_engine(cfg, world=3)
    separate = tiny_cfg("rollout.engine=toy_able", "rollout.engine_tp=2", "rollout.placement=separate",
                        "rollout.engine_ranks=2")
    check_engine(separate, world=3)  # the engine ranks hold the engines (rollout.engine_ranks, checked at load)


def test_an_unknown_engine_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"^rollout.engine='nope' is not one of \['hf', 'hf_static', 'sglang', "
                                          r"'vllm'\]$"):
        check_engine(tiny_cfg("rollout.engine=nope"))


def test_replicas_are_consecutive_ranks():
    assert replicas(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert replicas(4, 1) == [[0], [1], [2], [3]]
    with pytest.raises(ConfigError):
        replicas(4, 3)


def test_the_registered_engines_declare_what_they_run():
    assert {n: (c.tensor_parallel, c.can_sleep, c.runs_separate, c.takes_slices) for n, c in ENGINES.items()} == {
        "hf": (False, False, True, False), "hf_static": (False, False, True, False),
        "vllm": (True, True, True, True), "sglang": (False, False, False, False)}
    assert ENGINES["hf"].families is None and ENGINES["sglang"].families == ("qwen3_moe",)
    assert "gpt_oss" in ENGINES["vllm"].families


# String constants equal to an engine's name that mean something else: the default engine of a config, the sglang
# and vllm packages (their versions, whether one is installed), the tokenizer kind an export records and the folder a
# language-model run saves to.
OTHER_MEANINGS = {("moe_gspo/config/run.py", "hf"), ("moe_gspo/cli.py", "sglang"),
                  ("moe_gspo/checkpoint/export.py", "hf"), ("moe_gspo/commands/lm.py", "hf"),
                  ("moe_gspo/rollout/vllm/families.py", "vllm")}


def test_no_engine_name_appears_outside_its_own_module():
    """Outside the module that registers an engine, no code compares or passes its name (docstrings aside): the
    rest of the package asks the engine class's declarations."""
    own = {name: cls.__module__.replace(".", "/") + ".py" for name, cls in ENGINES.items()}
    found = []
    for path in sorted((ROOT / "moe_gspo").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in own and id(node) not in docs
                    and rel != own[node.value] and (rel, node.value) not in OTHER_MEANINGS):
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert found == []
