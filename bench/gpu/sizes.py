"""How big each part of the kit runs: on a GPU (:data:`GPU`), and on CPU for the dry run
that keeps the kit from rotting (:data:`DRY_RUN`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    sync_images: int  # images per step of the host-synchronisation check (two views each)
    sync_resolution: int
    sync_steps: int  # steps counted per objective, after two uncounted ones
    dense_n: tuple[int, ...]  # objectives: embeddings per batch, dense
    tiled_n: tuple[int, ...]  # and over column tiles
    tile_bytes: int  # a tiled case's [N, T] float32 buffer at most this many bytes
    step_backbones: tuple[str, ...]  # training-step throughput: model.backbone values
    step_images: int  # images per step (two views each)
    step_resolution: int
    step_steps: int  # timed steps, after three uncounted ones
    feed_cases: tuple[tuple[str, int, str], ...]  # feed: data.backend, workers, decoder
    feed_images: int  # feed: JPEGs of ImageNet's mean size a backend's epoch, two views each
    e2e_jpeg_sizes: tuple[tuple[int, int], ...]  # e2e: JPEG sizes trained from (feed: first)
    e2e_backbones: tuple[str, ...]  # e2e: the models trained from shards
    e2e_steps: int  # e2e: steps of one epoch of the shards
    e2e_window: int  # e2e: steps a metric row spans (the first row, with start-up, not counted)
    e2e_workers: int  # e2e: data.workers of the device backend
    views_jpegs: tuple[tuple[tuple[int, int], int], ...]  # views: (width, height), count
    views_batch: int  # views: images a batch
    views_batches: int  # views: batches compared, each decoder
    views_resolution: int
    views_workers: int  # views: loader workers of both paths
    compile_backbone: str
    compile_backend: str  # torch.compile's backend for the compile part
    demo_samples: int  # cluttered digits for the demo pipeline's training shards
    demo_steps: int
    fsdp2_models: tuple[str, ...]  # the fsdp2 part's models (bench.gpu.pipeline.FSDP2_MODELS)
    sharded_recipes: tuple[str, ...]  # the sharded part's recipes (launch/configs/<name>.yaml)
    sharded_images: int  # their images per step (two views each); 0: the recipe's batch
    sharded_model: dict  # model.* keys over the recipe's
    sharded_compile: bool  # the first recipe compiled too (train.compile)


GPU = Sizes(sync_images=64, sync_resolution=32, sync_steps=3,
            dense_n=(8192,), tiled_n=(65_536, 262_144, 1_048_576), tile_bytes=2**32,
            step_backbones=("resnet50", "timm:vit_base_patch16_224"), step_images=128,
            step_resolution=224, step_steps=10,
            feed_cases=(("cpu", 4, ""), ("cpu", 8, ""), ("cpu", 16, ""),
                        ("nvjpeg", 2, "torchcodec"), ("nvjpeg", 4, "torchcodec"),
                        ("nvjpeg", 4, "torchvision")),
            feed_images=8192, e2e_jpeg_sizes=((400, 350), (1000, 750)),
            e2e_backbones=("resnet50", "timm:vit_base_patch16_224"), e2e_steps=30,
            e2e_window=10, e2e_workers=4,
            views_jpegs=(((4000, 3000), 64), ((3000, 4000), 64), ((1024, 768), 2000),
                         ((768, 1024), 2000), ((500, 375), 6000), ((375, 500), 6000)),
            views_batch=16, views_batches=1000, views_resolution=64, views_workers=8,
            compile_backbone="resnet50", compile_backend="inductor", demo_samples=2000,
            demo_steps=60,
            fsdp2_models=("small_cnn", "vit_hybrid"),
            sharded_recipes=("imagenet_xclr_vitl", "cc12m_clip_vitl"), sharded_images=0,
            sharded_model={}, sharded_compile=True)

DRY_RUN = Sizes(sync_images=4, sync_resolution=16, sync_steps=1,
                dense_n=(64,), tiled_n=(256,), tile_bytes=2**14,
                step_backbones=("small_cnn", "timm:test_vit"), step_images=4,
                step_resolution=32, step_steps=1,
                feed_cases=(("cpu", 1, ""), ("nvjpeg", 1, "torchcodec"),
                            ("nvjpeg", 1, "torchvision")), feed_images=16,
                e2e_jpeg_sizes=((80, 60),), e2e_backbones=("small_cnn",),  # GPU: 2, same path
                e2e_steps=4, e2e_window=2, e2e_workers=1,
                views_jpegs=(((120, 90), 4), ((90, 120), 4), ((40, 30), 4)), views_batch=4,
                views_batches=3, views_resolution=16, views_workers=1,
                # dynamo's capture and AOT autograd without inductor's C++ codegen (30 s
                # cold here); inductor on CPU: tests/pretrain/loop/test_compile.py
                compile_backbone="small_cnn", compile_backend="aot_eager", demo_samples=200,
                demo_steps=4,
                fsdp2_models=("small_cnn",), sharded_recipes=("imagenet_xclr_vitl",),
                sharded_images=2, sharded_model={"backbone": "timm:test_vit", "image_size": 32,
                                                 "projector_hidden": 32, "projector_dim": 16},
                sharded_compile=False)
