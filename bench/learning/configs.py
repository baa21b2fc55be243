"""The configurations the learning benchmark trains.

``main``: one recipe per objective on the cluttered digits (``launch/configs/cluttered/``),
the batch-16 pair (FlatNCE), the negatives sweep (SupCon with k negatives), the untrained
floor and the cross-entropy ceiling, each for every seed; the same recipes on the plain
digits for reference. ``sweep``: the one-seed variations that chose each recipe's values
(``docs/learning.md``).
"""

from __future__ import annotations

from bench.learning.runs import Configuration

RECIPES = "launch/configs/cluttered"
TAU01 = ("objective.temperature=0.1",)  # the supervised recipes' earlier temperature
TEN = ("train.epochs=10",)  # the self-supervised recipes' earlier budget (their sweeps)
PAPER_BIAS = ("objective.siglip.bias=-10.0",)  # SigLIP's earlier start, the paper's
TAU_S01 = ("objective.xclr.target_temperature=0.1",)  # X-CLR's earlier tau_s, the paper's
OBJECTIVES = {  # configuration name -> (recipe file, overrides)
    "infonce": ("infonce.yaml", ()),
    "flatnce": ("flatnce.yaml", ()),
    "holder_flatnce": ("holder_flatnce.yaml", ()),
    "supcon": ("supcon.yaml", ()),
    "sincere": ("sincere.yaml", ()),
    "eps_supinfonce": ("eps_supinfonce.yaml", ()),
    "xclr_class_graph": ("xclr_class_graph.yaml", ()),
    "xclr_captions": ("xclr_captions.yaml", TAU_S01),  # as measured, on the plain store
    "projnce_centroid": ("projnce.yaml", ("objective.projnce.projection=centroid",)),
    # kernel and median learn better at the earlier 0.1 (docs/learning.md)
    "projnce_kernel": ("projnce.yaml", ("objective.projnce.projection=kernel", *TAU01)),
    "projnce_median": ("projnce.yaml", ("objective.projnce.projection=median", *TAU01)),
    "projnce_learned": ("projnce_learned.yaml", ()),
    "clip": ("clip.yaml", ()),
    "siglip": ("siglip.yaml", ()),
}
ALT_TEXT = {  # on the alt-text captions (data "alt_text"), each at the same 30 epochs
    "alt_clip": ("clip.yaml", ()),
    # CLIP with its own text tower from random weights, as the X-CLR paper's CC3M CLIP
    "alt_clip_scratch": ("clip.yaml", ("model.text.trainable=true", "model.text.scratch_layers=2",
                                       "model.text.scratch_width=128")),
    "alt_siglip": ("siglip.yaml", ()),
    "alt_xclr_captions": ("xclr_captions.yaml", ()),
    "alt_infonce": ("infonce.yaml", ()),
}
SMALL_BATCH = {  # FlatNCE's claim: global batch 16 (8 per rank)
    "infonce_b16": ("infonce.yaml", ("data.batch_size=8", *TEN)),
    "flatnce_b16": ("flatnce.yaml", ("data.batch_size=8", *TEN)),
}
NEGATIVES = {f"supcon_k{k}": ("supcon.yaml", (f"objective.num_negatives={k}",))
             for k in (1, 4, 16, 64)}
VIT = ("model.backbone=timm:test_vit", "model.patch_size=4")
AVG_POOL = "model.timm_kwargs={global_pool: avg, class_token: false}"
VIT_SCHEDULE = ("optim.lr=0.0003", "optim.warmup_steps=100", "train.epochs=20")
BACKBONES = {  # the SupCon recipe with another backbone: a ViT of the small CNN's size
    # timm's test_vit: width 64, 6 blocks, 0.26 M parameters (the CNN of width 32: 0.24 M)
    "supcon_vit": ("supcon.yaml", VIT),
    "vit_supcon": ("vit_supcon.yaml", ()),  # the transformer recipe
}
BACKBONE_REFERENCES = {  # the ViT recipe's own floor (untrained) and ceiling (cross-entropy)
    "untrained_vit": ("vit_supcon.yaml", ()),
    "cross_entropy_vit": ("vit_supcon.yaml", ()),
    "cross_entropy_supcon_vit": ("supcon.yaml", VIT),  # supcon_vit's ceiling
}
DIGITS_OBJECTIVES = ("infonce", "flatnce", "supcon", "sincere", "xclr_class_graph",
                     "projnce_centroid")
LARS = ("optim.name=lars", "optim.lr=0.3", "optim.weight_decay=1e-6")  # SimCLR's recipe
SWEEP = {  # name -> (recipe, overrides), each varying one choice (--sweep-seeds: seeds)
    "sweep_infonce_projector_linear": ("infonce.yaml", (*TEN, "model.projector_bn_out=false")),
    "sweep_infonce_lars": ("infonce.yaml", (*TEN, *LARS)),
    "sweep_infonce_lr0.002": ("infonce.yaml", (*TEN, "optim.lr=0.002")),
    "sweep_infonce_lr0.008": ("infonce.yaml", (*TEN, "optim.lr=0.008")),
    "sweep_infonce_batch32": ("infonce.yaml", (*TEN, "data.batch_size=32")),
    "sweep_infonce_batch128": ("infonce.yaml", (*TEN, "data.batch_size=128")),
    "sweep_infonce_tau0.05": ("infonce.yaml", (*TEN, "objective.temperature=0.05")),
    "sweep_infonce_tau0.2": ("infonce.yaml", (*TEN, "objective.temperature=0.2")),
    "sweep_infonce_flip_blur": ("infonce.yaml", (*TEN, "data.flip=0.5", "data.blur=0.5")),
    "sweep_infonce_cifar_color": ("infonce.yaml", (*TEN, "data.color_strength=0.5", "data.hue=null",
                                                   "data.grayscale=0.2")),
    "sweep_infonce_crop0.5": ("infonce.yaml", (*TEN, "data.crop_min_scale=0.5")),
    "sweep_infonce_width64": ("infonce.yaml", (*TEN, "model.width=64")),
    "sweep_infonce_epochs20": ("infonce.yaml", ("train.epochs=20",)),
    "sweep_infonce_epochs10": ("infonce.yaml", TEN),
    "sweep_flatnce_epochs10": ("flatnce.yaml", TEN),
    "sweep_infonce_gray1.0": ("infonce.yaml", (*TEN, "data.grayscale=1.0")),
    "sweep_infonce_gray0": ("infonce.yaml", (*TEN, "data.grayscale=0.0")),
    "sweep_infonce_split_views": ("infonce.yaml", (*TEN, "model.split_views=true")),
    "sweep_infonce_blur": ("infonce.yaml", (*TEN, "data.blur=0.5")),
    "sweep_infonce_gray_second": ("infonce.yaml", (*TEN, "data.grayscale=0.0",
                                                   "data.grayscale_second=1.0")),
    "sweep_supcon_projector_linear": ("supcon.yaml", ("model.projector_bn_out=false",)),
    "sweep_supcon_projector_linear_lars": ("supcon.yaml",
                                           ("model.projector_bn_out=false", *LARS)),
    "sweep_supcon_lars": ("supcon.yaml", LARS),
    "sweep_supcon_tau0.1": ("supcon.yaml", TAU01),
    "sweep_supcon_strong_color": ("supcon.yaml", ("data.color_strength=1.0", "data.hue=0.5",
                                                  "data.grayscale=0.5")),
    "sweep_supcon_crop0.3": ("supcon.yaml", ("data.crop_min_scale=0.3",)),
    "sweep_sincere_tau0.1": ("sincere.yaml", TAU01),
    "sweep_projnce_learned_tau0.1": ("projnce_learned.yaml", TAU01),
    "sweep_eps_supinfonce_tau0.1": ("eps_supinfonce.yaml", TAU01),
    "sweep_xclr_class_graph_tau0.1": ("xclr_class_graph.yaml", TAU01),
    "sweep_projnce_centroid_tau0.1": ("projnce.yaml",
                                      ("objective.projnce.projection=centroid", *TAU01)),
    "sweep_projnce_kernel_tau0.2": ("projnce.yaml", ("objective.projnce.projection=kernel",)),
    "sweep_projnce_median_tau0.2": ("projnce.yaml", ("objective.projnce.projection=median",)),
    "sweep_xclr_class_graph_tau_s0.1": ("xclr_class_graph.yaml",
                                        ("objective.xclr.target_temperature=0.1",)),
    "sweep_xclr_captions_tau_s0.05": ("xclr_captions.yaml",
                                      ("objective.xclr.target_temperature=0.05",)),
    "sweep_xclr_captions_epochs10": ("xclr_captions.yaml", TEN),
    "sweep_xclr_captions_no_color_jitter": ("xclr_captions.yaml", (
        "data.color_strength=0.0", "data.grayscale=0.0")),
    # a ViT recipe: SupCon's with the ViT's usual optimisation changes, one at a time
    "sweep_supcon_vit_lr0.001_warmup100": ("supcon.yaml", (
        *VIT, "optim.lr=0.001", "optim.warmup_steps=100")),
    "sweep_supcon_vit_projector_linear": ("supcon.yaml", (
        *VIT, "model.projector_bn_out=false")),
    "sweep_supcon_vit_layer_decay0.75": ("supcon.yaml", (*VIT, "optim.layer_decay=0.75")),
    "sweep_supcon_vit_epochs30_lr0.001": ("supcon.yaml", (
        *VIT, "train.epochs=30", "optim.lr=0.001", "optim.warmup_steps=100")),
    # the small-data levers, one at a time: a convolutional stem (Xiao et al. 2021), average
    # pooling without a class token, and both
    "sweep_supcon_vit_conv_stem": ("supcon.yaml", (*VIT, "model.vit_stem=conv")),
    "sweep_supcon_vit_avg_pool": ("supcon.yaml", (*VIT, AVG_POOL)),
    "sweep_supcon_vit_conv_stem_avg_pool": ("supcon.yaml", (*VIT, "model.vit_stem=conv",
                                                            AVG_POOL)),
    # ... at a ViT's learning rate (DeiT: 5e-4 per 512 images) with a long warmup, for twice
    # the CNN's epochs (within 3x its training time)
    "sweep_supcon_vit_avg_pool_lr3e-4_epochs20": ("supcon.yaml", (
        *VIT, AVG_POOL, *VIT_SCHEDULE)),
    "sweep_supcon_vit_conv_stem_avg_pool_lr3e-4_epochs20": ("supcon.yaml", (
        *VIT, "model.vit_stem=conv", AVG_POOL, *VIT_SCHEDULE)),
    # the hybrid (vit_supcon.yaml: the small CNN's first 3 blocks as the tokenizer), from
    # the CNN recipe's 10 epochs: its learning rate, and twice the epochs
    "sweep_vit_hybrid_epochs10": ("vit_supcon.yaml", ("train.epochs=10",)),
    "sweep_vit_hybrid_epochs10_lr0.004": ("vit_supcon.yaml", ("train.epochs=10",
                                                              "optim.lr=0.004")),
    # the stem alone (no transformer block): what the 6 blocks add
    "sweep_vit_hybrid_depth0": ("vit_supcon.yaml", (
        "model.timm_kwargs={global_pool: avg, class_token: false, depth: 0}",)),
    # SigLIP's bias started near -log(texts in the batch) instead of the paper's -10
    "sweep_siglip_bias-5": ("siglip.yaml", (*TEN, "objective.siglip.bias=-5.0")),
    # the temperature and bias at 10x the lr (they move by at most lr per AdamW step)
    "sweep_siglip_loss_lr10": ("siglip.yaml", (*TEN, *PAPER_BIAS, "optim.loss_lr_scale=10")),
    "sweep_siglip_tau0.05": ("siglip.yaml", (*TEN, *PAPER_BIAS, "objective.temperature=0.05")),
    # a sharper t with b scaled so a caption at cosine 2/3 sits at probability 1/2: the
    # near-duplicate captions a batch holds are pushed away, the far ones left alone
    "sweep_siglip_t30_b-20": ("siglip.yaml", (*TEN, "objective.temperature=0.0333333",
                                              "objective.siglip.bias=-20.0")),
    # the budget: does SigLIP catch up with CLIP given 3x the epochs, or plateau?
    "sweep_siglip_epochs10": ("siglip.yaml", (*TEN, *PAPER_BIAS)),
    "sweep_clip_epochs10": ("clip.yaml", TEN),
    "sweep_siglip_t30_b-20_fixed_t": ("siglip.yaml", (
        *TEN, "objective.temperature=0.0333333", "objective.siglip.bias=-20.0",
        "objective.learnable_temperature=false")),
}


ALT_SWEEP = {  # the image-text recipes' levers on the alt-text captions, one at a time
    # the budget: at 10 epochs neither leaves its plateau (docs/learning.md)
    "sweep_alt_clip_epochs10": ("clip.yaml", TEN),
    "sweep_alt_siglip_epochs10": ("siglip.yaml", (*TEN, *PAPER_BIAS)),
    "sweep_alt_siglip_bias-10": ("siglip.yaml", PAPER_BIAS),  # the paper's start, 30 epochs
    "sweep_alt_clip_text_trainable": ("clip.yaml", ("model.text.trainable=true",)),
    # 64 pairs a step: half as many captions of the anchor's class among its negatives
    "sweep_alt_clip_batch32": ("clip.yaml", ("data.batch_size=32",)),
    # 16 random negatives an anchor: about 1.3 of its own class among them, not 24
    "sweep_alt_clip_negatives16": ("clip.yaml", ("objective.num_negatives=16",)),
    "sweep_alt_clip_tau0.1": ("clip.yaml", ("objective.temperature=0.1",)),
    # the bias started at -log(128), the log-odds of one positive among a step's 128 texts
    "sweep_alt_siglip_bias-5": ("siglip.yaml", ("objective.siglip.bias=-5.0",)),
    # X-CLR's levers, one at a time from the previous caption recipe (tau_s 0.1 on the plain
    # store; docs/learning.md, "X-CLR on web captions"); the data set names the store
    "sweep_alt_xclr_tau_s0.1": ("xclr_captions.yaml", TAU_S01),  # the previous recipe
    "sweep_alt_xclr_tau_s0.05": ("xclr_captions.yaml", ("objective.xclr.target_temperature=0.05",)),
    "sweep_alt_xclr_tau_s0.2": ("xclr_captions.yaml", ("objective.xclr.target_temperature=0.2",)),
    "sweep_alt_xclr_batch128": ("xclr_captions.yaml", (*TAU_S01, "data.batch_size=128")),
    "sweep_alt_xclr_epochs60": ("xclr_captions.yaml", (*TAU_S01, "train.epochs=60")),
    "sweep_alt_xclr_top_k16": ("xclr_captions.yaml", (*TAU_S01, "objective.xclr.top_k=16")),
    # a third item names the data: the caption store made with graph.center=true
    "sweep_alt_xclr_centred": ("xclr_captions.yaml", TAU_S01, "alt_text_centred"),
    # the levers that helped, together
    "sweep_alt_xclr_tau_s0.05_centred": ("xclr_captions.yaml", (
        "objective.xclr.target_temperature=0.05",), "alt_text_centred"),
    "sweep_alt_xclr_tau_s0.05_centred_batch128": ("xclr_captions.yaml", (
        "objective.xclr.target_temperature=0.05", "data.batch_size=128"), "alt_text_centred"),
}


def _configs(table: dict, data: str, seeds: list[int], prefix: str = "") -> list[Configuration]:
    """Each entry (recipe, overrides[, data]) at each seed; ``data`` unless the entry names
    its own."""
    return [Configuration(f"{prefix}{name}-s{seed}", f"{RECIPES}/{recipe}",
                          own[0] if own else data, tuple(overrides), seed, {"group": name})
            for name, (recipe, overrides, *own) in table.items() for seed in seeds]


def floor_and_ceiling(data: str, seeds: list[int], prefix: str = "") -> tuple[
        list[Configuration], list[Configuration]]:
    floor = _configs({"untrained": ("infonce.yaml", ())}, data, seeds, prefix)
    ceiling = _configs({"cross_entropy": ("supcon.yaml", ())}, data, seeds, prefix)
    return floor, ceiling


def main(seeds: list[int], only: set[str] | None = None) -> list[Configuration]:
    table = {**OBJECTIVES, **SMALL_BATCH, **NEGATIVES, **BACKBONES, **BACKBONE_REFERENCES}
    if only:
        table = {k: v for k, v in table.items() if k in only}
    return _configs(table, "cluttered", seeds)


def alt_text(seeds: list[int], only: set[str] | None = None) -> list[Configuration]:
    """The image-text comparison on the alt-text captions (its floor is the cluttered
    digits' untrained encoder: the same canvases, the same seeds)."""
    table = {k: v for k, v in ALT_TEXT.items() if not only or k in only}
    return _configs(table, "alt_text", seeds)


def digits(seeds: list[int]) -> list[Configuration]:
    """The reference on the plain digits (the self-supervised recipes at 10 epochs)."""
    table = {k: OBJECTIVES[k] for k in DIGITS_OBJECTIVES}
    for name in ("infonce", "flatnce"):
        table[name] = (table[name][0], (*table[name][1], *TEN))
    return _configs(table, "digits", seeds, "digits_")


def sweep(seeds: list[int], only: set[str] | None = None) -> list[Configuration]:
    table = {k: v for k, v in SWEEP.items() if not only or k in only}
    alt = {k: v for k, v in ALT_SWEEP.items() if not only or k in only}
    return _configs(table, "cluttered", seeds) + _configs(alt, "alt_text", seeds)


def every(seeds: list[int]) -> list[Configuration]:
    """Every configuration the benchmark runs at ``seeds``, in all its parts."""
    return [*(conf for data, prefix in (("cluttered", ""), ("digits", "digits_"))
              for part in floor_and_ceiling(data, seeds, prefix) for conf in part),
            *main(seeds), *alt_text(seeds), *digits(seeds), *sweep(seeds)]
