"""Theory helpers that build tensors of their own (identities, coefficient vectors, frequency grids) put them on their
inputs' device. Inputs on PyTorch's ``meta`` device make any CPU-built tensor fail here as a CUDA run fails:
universality's ridge fit did on an H200 (2026-11-27) while every CPU test passed."""
import pytest
import torch

from featlearn.lightning_modules.modular_transformer import head_spectra
from featlearn.theory.two_layer import mds_embedding
from featlearn.theory.universality import closed_form_representation, layout, predicted_column_norms
from featlearn.theory.universality_downstream import ridge_fit

META = torch.device("meta")


@pytest.mark.parametrize("m,k", [(5, 8), (9, 4)], ids=["wide", "tall"])  # the two branches of the solve
def test_ridge_fit_stays_on_its_inputs_device(m, k):
    F = torch.empty(m, k, dtype=torch.float64, device=META)
    out = ridge_fit(F, torch.empty(m, dtype=torch.float64, device=META), 0.1)
    assert out.device == META and out.shape == (k,)


def test_mds_embedding_stays_on_its_inputs_device():
    out = mds_embedding(torch.empty(6, 3, device=META))
    assert out.device == META and out.shape == (6, 2)


def test_closed_form_representation_stays_on_its_basis_device():
    g = layout(T=2, s=1, r=2, u=1)
    out = closed_form_representation(g, torch.empty(4, 4, device=META), predicted_column_norms("universal", 2, 1, 2))
    assert out.device == META and out.shape == (g["k"], 4)


def test_head_spectra_stays_on_its_matrices_device():
    # the modular transformer's head_top_power indexed CUDA frequencies with a CPU arange (an H200, 2026-11-27)
    out = head_spectra(torch.empty(3, 7, 7, device=META))
    assert out["top_power"].device == META and out["frequency"].device == META
    assert out["top_power"].shape == (3,) and out["frequency"].shape == (3, 2)
