"""The DDP equivalence cases of ``tests/test_ddp.py``: per method a config, its tiny sizes, the per-device batch,
the one-device batch of the power run and the parameter dtype (``from ddp_cases import CASES, DEFAULT``)."""
import torch

MRP_DATA = ["--data.k", "4", "--data.d", "32", "--data.P", "8", "--data.s", "1.0", "--data.num_pretrain", "64",
            "--data.num_downstream", "32", "--data.num_val", "32", "--data.num_test", "32"]
SPARSE = ["--data.d", "8", "--data.d1", "32", "--data.num_val", "64", "--data.num_test", "64",
          "--model.width", "8", "--model.lr", "0.2", "--model.backend", "torch"]
PATCHES = ["--data.dim", "12", "--data.num_patches", "8", "--data.num_feature_patches", "2",
           "--data.num_val", "32", "--data.num_test", "32", "--model.backend", "torch"]

VIT_DATA = ["--data.P", "64", "--data.kappa_c", "0.75", "--data.kappa_s", "0.5", "--data.num_val", "8",
            "--data.num_test", "8"]

MRP = ["--model.lr", "20", "--model.m", "2", "--model.backend", "torch"]
NC = ["--model.lr", "0.5", "--model.head_lr", "0.5"]

# name: (config, overrides, per-device batch B (None: full batch), one-device batch of the power run
# (None: no batch to split), parameter dtype)
CASES = {
    # online minibatches; the shared pool (N = 16 > 2B) spans both devices' anchors
    "contrastive": ("contrastive/random_mask.yaml", SPARSE + ["--data.num_negatives", "16"], 4, 4, torch.float32),
    # full batch split over ranks by interleaved indices; N = 10 < n takes one negative from 10 of 16 anchors
    "contrastive_full_batch": ("contrastive/random_mask.yaml",
                               SPARSE + ["--data.num_negatives", "10", "--data.mode", "fixed",
                                         "--data.num_train", "16", "--data.batch_size", "null"], None, 8,
                               torch.float32),
    # full-batch GD on the mask-expected loss: the two halves' gradients must average to the full one
    "mrp_teacher_student": ("mrp/teacher_student.yaml", MRP_DATA + MRP, None, 32, torch.float32),
    # sampled masks (a function of step and sample index), reshuffled minibatches over 3 epochs
    "mrp_teacher_student_mc": ("mrp/teacher_student_mc.yaml", MRP_DATA + MRP, 16, 16, torch.float32),
    "mrp_supervised": ("mrp/supervised.yaml", MRP_DATA + MRP, 8, 8, torch.float32),
    # batch-norm statistics are synced over ranks: the loss is a global one
    "noncontrastive_sample": ("noncontrastive/with_head.yaml", PATCHES + NC, 16, 16, torch.float64),
    # the exact population gradient ignores the batch; every rank computes it in full, so a DDP that summed
    # the ranks' gradients, or a module that rescaled them by the world size, would step twice as far
    "noncontrastive_population": ("noncontrastive/with_head_population.yaml", PATCHES + NC, 2, None,
                                  torch.float64),
    # ViT MAE, structured path: each rank's masked-patch loss averages to the global batch's
    "vit_mae": ("vit/mae.yaml", VIT_DATA + ["--data.K", "3"], 4, 4, torch.float32),
    # ViT CL: every anchor's negatives are the other samples of the GLOBAL batch, gathered from the ranks
    "vit_cl": ("vit/cl.yaml", VIT_DATA + ["--data.K", "8", "--data.d", "128", "--model.lr", "2000"], 4, 4,
               torch.float32),
}
CASES.update({
    # dissertation ch. 2: full-batch steps 1-2 (each rank's half of the gradient), then minibatches
    "two_layer": ("two_layer/network.yaml",
                  ["--data.dim", "24", "--data.num_patterns", "12", "--data.k", "3", "--data.num_train", "64",
                   "--data.num_val", "16", "--data.num_test", "16", "--model.width", "8", "--model.backend", "torch",
                   "--model.reg3_mult", "0",  # at this size the theory's lambda would make the stage-3 decay negative
                   "--trainer.check_val_every_n_epoch", "1000"], 16, 16, torch.float32),
    # dissertation ch. 7: the loss's negatives (the batch mean) are the GLOBAL batch's, gathered with gradient
    "universality": ("universality/universal.yaml", ["--data.T", "2", "--data.num_test", "64"], 32, 32,
                     torch.float32),
    # dissertation ch. 4: epochs of the training half of Z_7^3 (172 tuples, 5 steps of 32 an epoch), each rank its
    # slice of the epoch's order; the fused op's embedding gradient adds rows with index_add_ (torch) per rank
    "modular_addition": ("modular_addition/mlp.yaml", ["--data.k", "3", "--data.p", "7", "--model.width", "12",
                                                       "--model.backend", "torch"], 16, 16, torch.float32),
    # its transformer (SDPA; dropout off: each rank would draw its own masks)
    "modular_transformer": ("modular_addition/transformer.yaml",
                            ["--data.k", "3", "--data.p", "7", "--model.heads", "2", "--model.hidden", "16",
                             "--model.head_dim", "4", "--model.mlp_hidden", "32", "--model.dropout", "0.0"], 16, 16,
                            torch.float32),
    # dissertation ch. 8: fresh prompts per step, each rank its half of the global batch
    "looped_transformer": ("looped_transformer/trained.yaml", ["--data.d", "3", "--data.n", "6"], 16, 16, torch.float32),
    # dissertation ch. 5 and 3: fresh prompts or samples per step, each rank its half of the global batch
    "icl_lsa": ("icl_scale/regression.yaml", ["--data.d", "4", "--data.N", "8", "--model.rank", "2"], 16, 16, torch.float32),
    "icl_parity": ("icl_scale/parity.yaml", ["--data.d", "4", "--data.N", "8", "--data.p_T", "0.1", "--model.heads", "4"],
                   16, 16, torch.float32),
    "gradient_features": ("gradient_features/xor.yaml", ["--data.d", "16", "--model.width", "4"], 64, 64, torch.float32),
    # dissertation ch. 6: the nuclear norm of the GLOBAL batch's features, gathered through autograd
    "erm_nu": ("erm_nu/theory.yaml", ["--data.r", "4", "--data.d", "16", "--data.gamma", "0.4", "--model.lam", "0.05"],
               32, 32, torch.float32),
    # dissertation ch. 9: the decoder's next-token loss on fresh prompts, each rank its half of the global batch
    "gemfilter": ("gemfilter/retrieval.yaml", ["--data.context", "64", "--data.train_context", "32", "--data.pairs", "4",
                                              "--data.queries", "2", "--data.fillers", "8", "--data.keys", "16",
                                              "--data.values", "8", "--model.layers", "2", "--model.heads", "2",
                                              "--model.head_dim", "8", "--model.hidden", "16", "--model.mlp_hidden",
                                              "32", "--model.rope_dims", "4", "--trainer.precision", "64-true"], 16, 16,
                  torch.float64),  # float64: Adam's normalised steps lift float32 reduction-order noise to 1e-5
    "gradient_features_parity": ("gradient_features/parity.yaml", ["--data.d", "16", "--data.k", "3", "--model.width", "4"],
                                 64, 64, torch.float32),
})
# in the default suite; the rest are marked slow, to keep the suite inside CI's budget (contrastive_full_batch: the
# pool of a fixed split over ranks is checked in process, tests/test_ddp.py, and contrastive keeps its DDP step)
DEFAULT = ("contrastive", "mrp_teacher_student", "mrp_supervised", "noncontrastive_sample", "noncontrastive_population",
           "vit_mae", "vit_cl", "two_layer", "universality")
