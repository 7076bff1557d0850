"""Dissertation Ch. 4: Lemma 4.11's construction attains the closed-form maximum margin gamma* (Lemma 4.10) with
the Fourier neurons Theorem 4.9 describes, no nearby network beats it, and the restricted / excluded losses
(Nanda et al.'s progress measures, for k inputs) split a network's logits into its circuit and the rest, on one
process, per seed of a stack and, for the whole-split metrics, over two DDP processes."""
import math
import random

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from featlearn.datamodules.modular_addition import ModularAdditionDataModule, decode
from featlearn.kernels.modular_power_mlp import modular_power_mlp_reference
from featlearn.lightning_modules.modular_addition import FourierMLP, theorem_width
from featlearn.theory.modular_addition import (ablation_losses, frequency_coverage, gamma_star, key_frequency_part,
                                               margins, max_margin_network, neuron_spectra, norm_2_kplus1)

SIZES = [(2, 5), (2, 7), (3, 5), (3, 7), (4, 5)]


def _all_logits(U: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tuple's logits from Eq. 4.2 (the op's plain reference, in U's float64), and the labels."""
    k, p = U.shape[0], U.shape[1]
    a = decode(torch.arange(p ** k), k, p)
    return modular_power_mlp_reference(a, U, W, k), a.sum(1) % p


def _normalised_margin(U, W):
    logits, y = _all_logits(U, W)
    return margins(logits, y).min() / norm_2_kplus1(U, W) ** (U.shape[0] + 1)  # (k+1)-homogeneous


@pytest.mark.parametrize("k, p", SIZES)
def test_the_construction_attains_gamma_star_with_every_tuple_on_the_margin(k, p):
    U, W = max_margin_network(k, p)
    assert U.shape == (k, p, theorem_width(k, p)) and float(norm_2_kplus1(U, W)) == pytest.approx(1.0, abs=1e-12)
    logits, y = _all_logits(U, W)
    m = margins(logits, y)
    assert float(m.min()) == pytest.approx(gamma_star(k, p), rel=1e-9)
    assert float((m.max() - m.min()) / m.min()) < 1e-9  # all on the margin (q = uniform, Def. 4.5)
    correct = torch.zeros_like(logits, dtype=torch.bool).scatter(1, y.unsqueeze(1), True)
    spread = logits.masked_fill(correct, -math.inf).amax(1) - logits.masked_fill(correct, math.inf).amin(1)
    assert float(spread.abs().max()) < 1e-9 * float(m.min())  # every wrong class alike (Condition 4.8)


@pytest.mark.parametrize("k, p", [(3, 7), (4, 5)])
def test_its_neurons_are_the_fourier_neurons_of_theorem_4_9(k, p):
    U, W = max_margin_network(k, p)
    s = neuron_spectra(U, W)
    assert bool(s["shared"].all()) and float(s["power"].min()) > 1 - 1e-12
    assert float(s["phase_residual"].abs().max()) < 1e-9
    assert frequency_coverage(s["frequency"], p).tolist() == [2 ** (2 * k - 1)] * ((p - 1) // 2)


@pytest.mark.parametrize("k, p", [(2, 5), (3, 5)])
def test_no_nearby_network_has_a_larger_normalised_margin(k, p):
    # gamma* is the maximum: fresh random directions, at two step sizes, never raise the normalised margin
    U, W = max_margin_network(k, p)
    best = float(_normalised_margin(U, W))
    seed = random.SystemRandom().randrange(1 << 31)  # fresh each run, without touching torch's global RNG
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        dU, dW = torch.randn(U.shape, generator=gen, dtype=U.dtype), torch.randn(W.shape, generator=gen, dtype=W.dtype)
        for eps in (1e-3, 1e-2):
            scale = eps / math.sqrt(float(dU.square().sum() + dW.square().sum()))
            assert float(_normalised_margin(U + scale * dU, W + scale * dW)) <= best * (1 + 1e-9), f"seed {seed}"
    assert float(_normalised_margin(2 * U, 2 * W)) == pytest.approx(best, rel=1e-12)  # scale-free


def test_key_frequency_part_separates_a_circuit_from_noise():
    # logits = the circuit at frequencies {1, 3} + a class bias + noise that is no function of the residue alone
    p = 7
    s = torch.arange(p, dtype=torch.float64)
    circuit = 3 * torch.cos(2 * math.pi * (s[:, None] - s) / p) + 2 * torch.cos(2 * math.pi * 3 * (s[:, None] - s) / p)
    table = circuit + torch.linspace(-1, 1, p, dtype=torch.float64)  # + each class's mean
    assert torch.allclose(key_frequency_part(table, torch.tensor([1, 3])), circuit, atol=1e-12)
    assert torch.allclose(key_frequency_part(table, torch.tensor([3])), circuit - 3 * torch.cos(
        2 * math.pi * (s[:, None] - s) / p), atol=1e-12)
    y = torch.randint(0, p, (500,), generator=torch.Generator().manual_seed(1))
    noise = torch.randn(500, p, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = ablation_losses(table, torch.tensor([1, 3]), table[y] + noise, y)
    mean_bias = torch.linspace(-1, 1, p, dtype=torch.float64)
    assert float(out["restricted"]) == pytest.approx(float(F.cross_entropy(table, torch.arange(p))), rel=1e-12)
    assert float(out["excluded"]) == pytest.approx(float(F.cross_entropy(mean_bias + noise, y)), rel=1e-12)


def test_the_module_logs_gamma_star_and_the_progress_measures_of_the_planted_circuit(tmp_path):
    # Lemma 4.11's network planted in FourierMLP (scaled up: the margin is scale-free): through a validation the
    # logged normalised margin is gamma*; the restricted loss keeps the circuit (the full loss), the excluded
    # loss removes it (left: each class's mean only, log p)
    k, p = 3, 5
    dm = ModularAdditionDataModule(k=k, p=p, batch_size=16, seed=3)
    model = FourierMLP(ablation=True).attach(dm)
    U, W = max_margin_network(k, p)
    with torch.no_grad():
        model.U.copy_(U * 3.0)
        model.W.copy_(W * 3.0)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    trainer.validate(model, datamodule=dm, verbose=False)
    logged = trainer.callback_metrics
    assert float(logged["theory/margin"]) == pytest.approx(gamma_star(k, p), rel=1e-5)
    assert float(logged["theory/key_frequencies"]) == (p - 1) // 2
    logits, y = _all_logits(U * 3.0, W * 3.0)
    assert float(logged["theory/restricted_loss"]) == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-4)
    assert float(logged["theory/excluded_loss"]) == pytest.approx(math.log(p), rel=1e-4)
    assert float(logged["val/acc"]) == 1.0


def test_each_seed_of_a_stack_ablates_over_its_own_split(tmp_path):
    # under --seeds the trainer's DataModule is the stack's: each member must evaluate its own seed's split
    from featlearn.cli import make_cli

    args = ["fit", "--config", "configs/modular_addition/mlp.yaml", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.k", "3", "--data.init_args.p", "5", "--data.init_args.batch_size", "16",
            "--model.init_args.width", "12", "--model.init_args.ablation", "true", "--trainer.max_steps", "6",
            "--trainer.val_check_interval", "3"]
    stack = make_cli([*args, "--seeds", "[3, 5]"]).model
    seeded = ["--seed_everything", "5", "--data.init_args.seed", "5", "--model.init_args.seed", "5"]
    alone = make_cli([*args, *seeded]).model
    member = stack.members[1]
    assert member.ablation_data.seed == 5
    mine, theirs = member.fourier_ablation(member.ablation_data), alone.fourier_ablation(alone.ablation_data)
    assert mine == theirs and mine["excluded_loss"] != stack.members[0].fourier_ablation(
        stack.members[0].ablation_data)["excluded_loss"]


def test_modular_addition_validation_counts_every_tuple_once(tmp_path):
    """Ch. 4's whole-split accuracies and loss on two processes (splits of 171 and 172 tuples: odd, so
    Lightning's default sampler would repeat one) equal one process's: each rank scores its own range, unpadded."""
    from test_ddp import CASES, _fit_logged

    config, overrides, batch = CASES["modular_addition"][:3]
    overrides = [*overrides, "--trainer.limit_val_batches", "1.0", "--trainer.val_check_interval", "2",
                 "--trainer.check_val_every_n_epoch", "null"]
    double = _fit_logged(tmp_path, config, overrides, devices=2, batch_size=batch, prefix="val/")
    single = _fit_logged(tmp_path, config, overrides, devices=1, batch_size=2 * batch, prefix="val/")
    assert {"val/acc", "val/train_acc", "val/loss"} <= set(single), sorted(single)
    for tag in ("val/acc", "val/train_acc", "val/loss"):
        assert double[tag] == pytest.approx(single[tag], rel=1e-5, abs=1e-7), tag
