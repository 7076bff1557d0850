"""A step's logged values, read without host syncs: what the divergence guard keeps every step and reads in one
transfer every few steps.

Example:
    >>> read_floats([torch.tensor(1.5), torch.tensor(2, dtype=torch.int64), torch.tensor(True)])
    [1.5, 2.0, 1.0]
"""
import torch


def callback_metrics(trainer) -> dict:
    """``trainer.callback_metrics`` without reading that property, which turns every ``prog_bar`` metric
    into a Python number (a host sync each): Lightning's stored metrics updated with this step's values,
    the way the property builds them. The property itself where Lightning's internals differ."""
    connector, results = getattr(trainer, "_logger_connector", None), getattr(trainer, "_results", None)
    stored = getattr(connector, "_callback_metrics", None)
    try:
        if not isinstance(stored, dict) or getattr(connector, "_first_loop_iter", None) is None:
            return trainer.callback_metrics
        out = dict(stored)
        if results is not None and results.training:
            for _, metric in results.valid_items():
                value = results._get_cache(metric, True)
                if isinstance(value, torch.Tensor):
                    name, forked = results._forked_name(metric, True)
                    out[name] = out[forked] = value
        return out
    except (AttributeError, TypeError, ValueError):
        return trainer.callback_metrics


def read_floats(tensors: list) -> list[float]:
    """0-d tensors as Python floats in one host transfer, stacked per dtype and device: one op per group, where a
    conversion each would be one op per value."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    if not groups:
        return []
    device = tensors[0].device
    got = torch.cat([torch.stack([tensors[i] for i in at]).to(device=device, dtype=torch.float64)
                     for at in groups.values()]).tolist()
    out = [0.0] * len(tensors)
    for i, value in zip((i for at in groups.values() for i in at), got):
        out[i] = value
    return out
