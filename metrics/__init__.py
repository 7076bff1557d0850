"""Metrics shared by every method: probes, feature-correlation statistics, figures for TensorBoard and PNGs."""
import torch


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU in float64 through one device-to-host copy: theory metrics cost one sync,
    not one per value. The tensors may sit on different devices (a count made on the CPU beside GPU metrics).

    Example:
        >>> out = to_host({"a": torch.tensor(1.0), "b": torch.ones(2, 2)})
        >>> float(out["a"]), out["b"].shape, out["b"].dtype
        (1.0, torch.Size([2, 2]), torch.float64)
    """
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in tensors.values()]).cpu()
    parts = flat.split([t.numel() for t in tensors.values()])
    return {k: p.view(t.shape) for (k, t), p in zip(tensors.items(), parts)}
