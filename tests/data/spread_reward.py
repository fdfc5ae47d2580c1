"""A reward that spreads over any responses, a random policy's included: a hash of the response's characters in
[0, 1]. Tests use it for advantages, and so gradients and Adam moments, from the first RL step without a cold start.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 11) / 10
