"""The papers whose theory featlearn runs, and one way to cite them.

Comments cite the short form ``<authors> <year>, <where>`` with the paper's own numbering, e.g.
``# Pan et al. 2023, Thm 2`` or ``# Wen & Li 2021, Lemma B.2``; runtime strings (figure titles, error
messages) use :func:`cite`. Theorem, lemma, section and appendix numbers are those of the versions listed
here: the ICLR 2025 version for Huang et al., and for the two dissertation chapters the dissertation's own
numbering (its Chapter 2 is Shi, Wei & Liang 2022 with Appendix A; Chapter 7 is Shi et al. 2023 with
Appendix F), since the code follows the dissertation's text.

Example:
    >>> cite("mrp", "Theorem 2")
    'Pan et al., ICLR 2023 (arXiv:2206.03826), Theorem 2'
    >>> cite("noncontrastive")
    'Wen & Li, NeurIPS 2022 (arXiv:2205.06226)'
    >>> PAPERS["vit"]["short"]
    'Huang et al. 2025'
"""

PAPERS: dict[str, dict[str, str]] = {
    # mask-reconstruction pretraining (teacher-student, MAE) vs supervised learning: featlearn's "mrp"
    "mrp": dict(
        authors="Jiachun Pan, Pan Zhou, Shuicheng Yan",
        title="Towards Understanding Why Mask-Reconstruction Pretraining Helps in Downstream Tasks",
        venue="ICLR", year="2023", arxiv="2206.03826", short="Pan et al. 2023"),
    # the multi-view data model the MRP paper builds on, and its Lemma 1 (supervised learning)
    "multiview": dict(
        authors="Zeyuan Allen-Zhu, Yuanzhi Li",
        title="Towards Understanding Ensemble, Knowledge Distillation and Self-Distillation in Deep Learning",
        venue="ICLR", year="2023", arxiv="2012.09816", short="Allen-Zhu & Li 2023"),
    # contrastive learning on sparse coding, with and without RandomMask
    "contrastive": dict(
        authors="Zixin Wen, Yuanzhi Li",
        title="Toward Understanding the Feature Learning Process of Self-supervised Contrastive Learning",
        venue="ICML", year="2021", arxiv="2105.15134", short="Wen & Li 2021"),
    # non-contrastive learning with an identity-initialised prediction head
    "noncontrastive": dict(
        authors="Zixin Wen, Yuanzhi Li",
        title="The Mechanism of Prediction Head in Non-contrastive Self-supervised Learning",
        venue="NeurIPS", year="2022", arxiv="2205.06226", short="Wen & Li 2022"),
    # one-layer softmax ViT: masked autoencoding vs contrastive learning
    "vit": dict(
        authors="Yu Huang, Zixin Wen, Yuejie Chi, Yingbin Liang",
        title="A Theoretical Analysis of Self-Supervised Learning for Vision Transformers",
        venue="ICLR", year="2025", arxiv="2403.02233", short="Huang et al. 2025"),
    # the dissertation whose Chapters 2 and 7 are built and Chapter 4 in progress (numbering: the dissertation's)
    "dissertation": dict(
        authors="Zhenmei Shi",
        title="Understanding Training and Adaptation in Feature Learning: "
              "From Two-Layer Networks to Foundation Models",
        venue="PhD dissertation, University of Wisconsin-Madison", year="2024", arxiv="", short="Shi 2024"),
    # its Chapter 2: two-layer networks vs fixed features on structured parity
    "two_layer": dict(
        authors="Zhenmei Shi, Junyi Wei, Yingyu Liang",
        title="A Theoretical Analysis on Feature Learning in Neural Networks: "
              "Emergence from Inputs and Advantage over Fixed Features",
        venue="ICLR", year="2022", arxiv="2206.01717", short="Shi, Wei & Liang 2022"),
    # its Chapter 7: universality vs label efficiency, contrastive regularisation
    "universality": dict(
        authors="Zhenmei Shi, Jiefeng Chen, Kunyang Li, Jayaram Raghuram, Xi Wu, Yingyu Liang, Somesh Jha",
        title="The Trade-off between Universality and Label Efficiency of Representations from Contrastive Learning",
        venue="ICLR", year="2023", arxiv="2303.00106", short="Shi et al. 2023"),
    # its Chapter 4 (in progress): Fourier circuits for k-input modular addition
    "modular_addition": dict(
        authors="Chenyang Li, Yingyu Liang, Zhenmei Shi, Zhao Song, Tianyi Zhou",
        title="Fourier Circuits in Neural Networks: Unlocking the Potential of Large Language Models in "
              "Mathematical Reasoning and Modular Arithmetic",
        venue="arXiv preprint", year="2024", arxiv="2402.09469", short="Li et al. 2024"),
}


def cite(key: str, where: str = "") -> str:
    """``"<first author> et al., <venue> <year> (arXiv:<id>)[, <where>]"`` for the paper ``key`` of :data:`PAPERS`.

    ``where`` is the place in the paper in its own numbering ("Theorem 2", "Lemma B.2", "Section 5.2").
    Raises ``KeyError`` naming the known keys for an unknown ``key``.
    """
    if key not in PAPERS:
        raise KeyError(f"paper {key!r}: must be one of {sorted(PAPERS)}")
    p = PAPERS[key]
    surnames = [a.split()[-1] for a in p["authors"].split(", ")]
    who = surnames[0] if len(surnames) == 1 else (" & ".join(surnames) if len(surnames) == 2
                                                   else f"{surnames[0]} et al.")
    text = f"{who}, {p['venue']} {p['year']}" + (f" (arXiv:{p['arxiv']})" if p["arxiv"] else "")
    return f"{text}, {where}" if where else text
