"""tests/data/spread_reward.py's reward, which also kills its own process with SIGKILL (as the out-of-memory killer
would) on the rank named by $MOE_GSPO_TEST_KILL_RANK, at its $MOE_GSPO_TEST_KILL_AT-th call. Without those variables
it only scores."""

import os
import signal

_calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global _calls
    _calls += 1
    if os.environ.get("RANK", "0") == os.environ.get("MOE_GSPO_TEST_KILL_RANK") and \
            _calls == int(os.environ.get("MOE_GSPO_TEST_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return (sum(map(ord, solution_str)) % 11) / 10
