"""A user's generation script, as people write them: a diffusers Stable Diffusion pipeline, a prompt, some steps. It
knows nothing of attnprof (it imports no profiler); `attnprof record -- docs/examples/generate.py --steps 3` profiles
it as it is.

With --model (a hub id or a folder) it loads that pipeline; without one it builds, offline, a tiny one from configs
with SD 1.5's real block topology (the U-Net of configs/models/tiny-sd15.yaml: the same levels, blocks, heads and
token counts; few channels), a small VAE of the SD VAE's topology, a small CLIP text encoder and a tokenizer it
writes itself. --pipeline picks the kind: txt2img (StableDiffusionPipeline), pag (perturbed-attention guidance) or
pix2pix (InstructPix2Pix: the U-Net takes the image's latents too).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

UNET = dict(act_fn="silu", attention_head_dim=8, block_out_channels=[32, 64, 64, 64], cross_attention_dim=32,
            down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
            downsample_padding=1, flip_sin_to_cos=True, freq_shift=0, in_channels=4, layers_per_block=2,
            mid_block_scale_factor=1, norm_eps=1e-5, norm_num_groups=8, out_channels=4, sample_size=64)
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 16, 32, 32], layers_per_block=2,
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, norm_num_groups=8,
           sample_size=512, scaling_factor=0.18215)
TEXT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100,
            max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
PIPELINES = {"txt2img": "StableDiffusionPipeline", "pag": "StableDiffusionPAGPipeline",
             "pix2pix": "StableDiffusionInstructPix2PixPipeline"}


def _tokenizer(folder: Path):
    """A CLIP tokenizer over single letters (no merges), written to folder: enough to turn a prompt into ids."""
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, **{t: i + 2 for i, t in
                                                          enumerate(letters + [f"{c}</w>" for c in letters])}}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def tiny_pipeline(kind: str = "txt2img", seed: int = 0, dtype=torch.float32):
    """The tiny pipeline of `kind`, its weights drawn from `seed` (the same pipeline every time)."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(**{**UNET, "in_channels": 8 if kind == "pix2pix" else 4})
    vae = diffusers.AutoencoderKL(**VAE)
    text = CLIPTextModel(CLIPTextConfig(**TEXT))
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = _tokenizer(Path(folder))
    scheduler = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    cls = getattr(diffusers, PIPELINES[kind])
    pipe = cls(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler, safety_checker=None,
               feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def generate(pipe, steps: int = 3, size: int = 64, guidance: float = 7.5, seed: int = 0, width: int | None = None,
             **kwargs):
    """One generation, as a script calls its pipeline: the images as an array. size x size, or width x size."""
    width = width or size
    if type(pipe).__name__ == PIPELINES["pix2pix"] and "image" not in kwargs:  # the image to edit
        kwargs["image"] = torch.rand(1, 3, size, width, generator=torch.Generator().manual_seed(seed))
    return pipe("a cat in a hat", num_inference_steps=steps, height=size, width=width, guidance_scale=guidance,
                generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs).images


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a hub id or folder of a Stable Diffusion pipeline (default: the tiny one)")
    p.add_argument("--pipeline", choices=sorted(PIPELINES), default="txt2img", help="the tiny pipeline's kind")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", type=int, default=64, help="image height in pixels, and width unless --width (default 64)")
    p.add_argument("--width", type=int, help="image width in pixels (default: --size)")
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.model:
        import diffusers

        pipe = diffusers.AutoPipelineForText2Image.from_pretrained(args.model)
    else:
        pipe = tiny_pipeline(args.pipeline)
    images = generate(pipe, args.steps, args.size, args.guidance, args.seed, args.width)
    print(f"generated {len(images)} image(s) of {images.shape[2]}x{images.shape[1]} in {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
