"""Which Hugging Face model families jaxpe has verified, as data (transformers 5.25.0).

A fact a config does not state (the pair layout, which dims of the head rotate, multi-axis
positions, latent-attention heads, a softmax scale convention, a config class's defaults) is read
from the tables of ``jaxpe.ops.hf_families`` only for a ``model_type`` listed in
``VERIFIED_FAMILIES``; ``rope_from_hf_config`` refuses any other family by name (``UnverifiedFamilyError``)
unless the caller states those facts (``layout=``, ``rotated_slice=``, ``rotary_dim=``), so a family
that a newer transformers adds is refused, never read with another family's defaults.

``VERIFIED_FAMILIES``: every ``model_type`` whose rotary module ``tests/ops/hf_families_test.py``
sweeps in transformers 5.25.0 (inv_freq, attention factor, cos/sin at token and multi-axis positions,
and the family's own ``apply_rotary_pos_emb`` / ``apply_rotary_pos_emb_interleave`` against
``HFRope.apply``), plus the families the tables name that only older transformers releases ship or
whose apply function the sweep cannot call (read from their modeling code: GLM-4V-MoE, GLM-Image,
HunYuan-VL rotate_half; GPT-J / CodeGen rotate_every_two). How to add a family: docs/maintenance.md.

``NO_ROPE_FAMILIES``: model types whose transformers modeling, modular and configuration files
name no rotary embedding at all (GPT-2, OPT, BLOOM, MPT, BERT, BART, T5, Mamba, Falcon-Mamba, ...)
and that are not composites of other configs (PI0 is PaliGemma + Gemma): refused as such, not as
unverified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class UnverifiedFamilyError(ValueError):
  """A Hugging Face config of a model family jaxpe has not verified against its transformers
  modeling code (``VERIFIED_FAMILIES``), read by ``jaxpe.rope_from_hf_config`` without the facts
  its config does not state. The message names the ``model_type``, the arguments that state those
  facts (``layout=``, ``rotated_slice=``, ``rotary_dim=``) and how to check them against the
  family's ``apply_rotary_pos_emb`` (docs/rope.md). A ``ValueError``, so existing ``except``
  clauses keep working."""


TRANSFORMERS_VERSION = "5.25.0"  # the release the lists were checked against

VERIFIED_FAMILIES: frozenset[str] = frozenset(
  """
afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 bailing_hybrid bamba beam bitnet blt
blt_global_transformer blt_local_decoder blt_local_encoder blt_patcher chameleon codegen cohere cohere2
cohere2_moe cohere_compass cohere_compass_vision cosmos3_edge cosmos3_edge_text csm
csm_depth_decoder_model cwm dbrx deepseek_ocr2_encoder deepseek_ocr2_text deepseek_v2 deepseek_v3
deepseek_v32 deepseek_v4 dia_decoder dia_encoder diffllama diffusion_gemma_text doge dory dots1
dots3_note_audio_encoder dots3_note_text dots3_note_vision_encoder edgetam_video embedding_gemma2_text
emu3_text_model ergo ernie4_5 ernie4_5_moe ernie4_5_vl_moe ernie4_5_vl_moe_text ernie4_5_vl_moe_vision
esmc eurobert evolla exaone exaone4 exaone4_5_vision exaone_moe falcon falcon_h1 flex_olmo flint gemma
gemma2 gemma3 gemma3_text gemma3n gemma3n_text gemma4_text gemma4_vision gemma4_unified_text glm glm4 glm4_moe
glm4_moe_lite glm4v glm4v_moe glm4v_moe_text glm4v_moe_vision glm4v_text glm4v_vision glm5_next_vision
glm_image glm_image_text glm_moe_dsa glm_ocr glm_ocr_text glm_ocr_vision glmasr_encoder gpt_neox
gpt_neox_japanese gpt_oss gptj gradium_phonon_tts granite granite4_vision_text granite_docling_text
granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared gte helium higgs_audio_v2
hrm_text hunyuan_v1_dense hunyuan_v1_moe hunyuan_vl hunyuan_vl_text hy_v3 hy_v4 hy_v4_vl hy_v4_vl_text
hyperclovax idefics inkling2_vision internlm3 iquestcoder jais2 jetmoe jina_embeddings_v3
kimi_k25_vision kolibri1 kolibri1_1 kyutai_speech_to_text laguna lara_mini lasr_encoder lfm2 lfm2_moe
lfm3 lfm3_vl_vision llama llama4 llama4_text llava_onevision1_5_vision longcat_flash mellum mimi
mimi_decoder mimi_encoder mimo_v2_flash minicpm3 minicpm5_moe minimax minimax_m2 minimax_m3_vl_text
minimax_m3_vl_vision ministral ministral3 mistral mistral4 mistral_large4 mistral_large4_text mixtral
mlcd_vision_model mllama_text_model modernbert modernbert-decoder molmo2_text moonshine
moonshine_streaming moshi muse_glimmer_assistant muse_glimmer_text muse_glimmer_vision muse_spark_text
muse_spark_vision nanochat nemotron nemotron3_5_transcribe_asr_audio
nemotron3_5_transcribe_word_timestamp nemotron3_diarization_audio neomme neucodec nomic_bert olmo olmo2
olmo3 olmo_hybrid olmoe openai_privacy_filter ovis2_5_vision paddleocr_vl paddleocr_vl_text
paddleocr_vl_vision param2moe pe_audio_encoder pe_audio_video_encoder pe_video_encoder persimmon phi
phi3 phi4_multimodal phimoe pixtral pocket_tts pocket_tts_audio_tokenizer
pocket_tts_audio_tokenizer_decoder pocket_tts_audio_tokenizer_encoder qwen2 qwen2_5_omni
qwen2_5_omni_dit qwen2_5_omni_talker qwen2_5_omni_text qwen2_5_omni_thinker qwen2_5_omni_vision_encoder
qwen2_5_vl qwen2_5_vl_text qwen2_5_vl_vision qwen2_moe qwen2_vl qwen2_vl_text qwen2_vl_vision qwen3
qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_moe_vision qwen3_5_text qwen3_5_vision qwen3_moe qwen3_next
qwen3_omni_moe qwen3_omni_moe_text qwen3_omni_moe_talker qwen3_omni_moe_talker_code_predictor qwen3_omni_moe_talker_text
qwen3_omni_moe_thinker qwen3_omni_moe_vision_encoder qwen3_vl qwen3_vl_moe qwen3_vl_moe_text
qwen3_vl_moe_vision qwen3_vl_text qwen3_vl_vision qwen4_exp qwen4_exp_text qwen4_exp_vision
recurrent_gemma sam2_video sam3_tracker_video sam3_vit_model sarvam_mla sarvam_moe seed_oss smollm3
solar_open stablelm starcoder2 step3p5 step3p5_vision t5_gemma_module t5gemma2_decoder t5gemma2_text
timesfm2_5 ultrabert unlimited_ocr_text vaultgemma video_llama_3_vision voxtral_realtime_encoder
voxtral_realtime_text xcodec2 youtu zamba2 zaya
  """.split()
)

NO_ROPE_FAMILIES: frozenset[str] = frozenset(
  """
aimv2_text_model aimv2_vision_model albert align_text_model align_vision_model altclip_text_model
altclip_vision_model audio-spectrogram-transformer audioflamingo3_encoder autoformer bart beit bert
bert-generation big_bird bigbird_pegasus biogpt bit blenderbot blenderbot-small blip_2_qformer
blip_2_vision_model blip_text_model blip_vision_model bloom bridgetower_text_model
bridgetower_vision_model bros camembert canine chinese_clip_text_model chinese_clip_vision_model chmv2
clap_audio_model clap_text_model clip_text_model clip_vision_model clipseg_text_model
clipseg_vision_model conditional_detr convbert convnext convnextv2 cpmant ctrl cvt d_fine dab-detr dac
data2vec-audio data2vec-text data2vec-vision deberta deberta-v2 decision_transformer deformable_detr
deit depth_anything depth_pro detr dinat dinov2 dinov2_with_registers dinov3_convnext distilbert
donut-swin dpr dpt edgetam edgetam_mask_decoder edgetam_prompt_encoder edgetam_vision_model efficientnet
electra encodec eomt ernie falcon_mamba fastspeech2_conformer fastspeech2_conformer_hifigan
fastspeech2_conformer_with_hifigan flaubert flava_image_codebook flava_image_model
flava_multimodal_model flava_text_model florence_vision fnet focalnet fsmt fun_asr_nano_encoder funnel
git git_vision_model glpn gpt-sw3 gpt2 gpt_bigcode gpt_neo granite_speech5_ctc granite_speech5_encoder
granite_speech_encoder granite_speech_plus_encoder groupvit_text_model groupvit_vision_model hgnet_v2
hiera higgs_audio_v2_tokenizer hubert ibert idefics2_perceiver idefics2_vision idefics3_vision ijepa
imagegpt informer inkling2_loop_text inkling_audio inkling_text inkling_vision instructblip_qformer
instructblip_vision_model instructblipvideo_qformer instructblipvideo_vision_model internvl_vision
janus_vision_model janus_vqgan kosmos_2_5_text_model kosmos_2_5_vision_model kosmos_2_text_model
kosmos_2_vision_model layoutlm layoutlmv2 layoutlmv3 layoutxlm led levit lilt longformer longt5 luke
lw_detr lw_detr_vit lxmert m2m_100 mamba mamba2 marian markuplm mask2former maskformer maskformer-swin
mbart megatron-bert metaclip_2_text_model metaclip_2_vision_model mgp-str minicpm_ocr_vision
minicpmv4_6_vision mobilebert mobilenet_v1 mobilenet_v2 mobilevit mobilevitv2 mpnet mpt mra mt5 musicgen
musicgen_decoder musicgen_melody musicgen_melody_decoder mvp nemotron3_5_asr nllb-moe nystromformer
omniasr_audio omniasr_ctc oneformer openai-gpt opt ovis2_vision owlv2_text_model owlv2_vision_model
owlvit_text_model owlvit_vision_model patchtsmixer patchtst pegasus pegasus_x perceiver
pix2struct_text_model pix2struct_vision_model pixio plbart poolformer pop2piano pp_doclayout_v3
pp_doclayout_v4 pp_formulanet_text pp_formulanet_vision pp_lcnet pp_lcnet_v3 pp_lcnet_v4
pp_ocrv5_mobile_det pp_ocrv5_mobile_rec pp_ocrv5_server_det pp_ocrv5_server_rec pp_ocrv6_medium_det
pp_ocrv6_small_det pp_ocrv6_small_rec pp_ocrv6_tiny_rec prompt_depth_anything prophetnet pvt pvt_v2
qianfan_ocr_vision qwen2_audio_encoder qwen3_asr_encoder radio reformer regnet rembert resnet rf_detr
rf_detr_dinov2 roberta roberta-prelayernorm roc_bert rt_detr rt_detr_resnet rt_detr_v2 rwkv sam sam2
sam2_hiera_det_model sam2_mask_decoder sam2_prompt_encoder sam2_vision_model sam3_lite_text_detr_decoder
sam3_lite_text_detr_encoder sam3_lite_text_geometry_encoder sam3_lite_text_mask_decoder
sam3_lite_text_text_model sam3_tracker sam3_tracker_mask_decoder sam3_tracker_prompt_encoder sam_hq
sam_hq_mask_decoder sam_hq_prompt_encoder sam_hq_vision_model sam_mask_decoder sam_prompt_encoder
sam_vision_model seamless_m4t_v2 segformer seggpt sew sew-d siglip2_text_model siglip2_vision_model
siglip_text_model siglip_vision_model slanet slanext slanext_vision smolvlm_vision speech_to_text
speecht5 speecht5_hifigan splinter squeezebert superglue superpoint swiftformer swin swin2sr swinv2
switch_transformers t5 table-transformer tapas textnet time_series_transformer timesfm timesformer
timm_backbone timm_wrapper tipsv2_dpt tipsv2_text_model tipsv2_vision_model trocr tvp udop umt5
unispeech unispeech-sat univnet upernet uvdoc uvdoc_backbone vibevoice_acoustic_tokenizer
vibevoice_acoustic_tokenizer_decoder vibevoice_acoustic_tokenizer_encoder vibevoice_diffusion videomae
videomt videoprism_text_model videoprism_vision_model vilt visual_bert vit vit_mae vit_msn vitdet
vitmatte vitpose vitpose_backbone vits vivit wav2vec2 wavlm wavtokenizer wavtokenizer_encoder whisper
xclip_text_model xclip_vision_model xcodec xglm xlm xlm-roberta xlm-roberta-xl xlnet xlstm xmod yolos
yoso zoedepth
  """.split()
)


def is_verified(model_type: Any) -> bool:
  """Whether the tables were checked on this ``model_type`` itself (``VERIFIED_FAMILIES``,
  transformers ``TRANSFORMERS_VERSION``). A new ``<family>_text`` type is not taken as verified
  because ``<family>`` is: the sweep lists each text config's type by itself."""
  return isinstance(model_type, str) and model_type in VERIFIED_FAMILIES


# Config keys whose meaning only a family's modeling code gives (read from the tables above for the
# verified families): an unverified family's config with one of them is refused even with the
# stated facts, since jaxpe would have to guess what the key does there.
FAMILY_SPECIFIC_KEYS = {
  "qk_rope_head_dim": "latent-attention (MLA) heads: which part of the head rotates and how wide it is",
  "rope_interleave": "MLA heads' pair layout flag",
  "mrope_section": "multi-axis (mRoPE) sections: their order over the head is the family's",
  "mscale_all_dim": "a softmax scale some families multiply by yarn_get_mscale(factor, mscale_all_dim) ** 2",
  "rotary_dim": "GPT-J-style rotated dims (the family's own key)",
  "rope_local_base_freq": "a base for some layer types (Gemma-3 style)",
  "local_rope_theta": "a base for some layer types (ModernBERT style)",
  "global_rope_theta": "a base for some layer types (ModernBERT style)",
  "rotary_emb_base": "GPT-NeoX's legacy spelling of the base",
  "rotary_pct": "GPT-NeoX's legacy spelling of the partial rotary factor",
  "kv_channels": "a head width under the family's own key (JetMoE)",
  "attention_head_dim": "a head width under the family's own key (Zamba2)",
  "rope_pct": "a partial rotary share under the family's own key (StableLM-epoch remote code)",
  "rotary_emb_fraction": "a partial rotary share under the family's own key (nomic-bert style)",
  "global_head_dim": "a head width for some layer types (Gemma-4 style)",
  "per_layer_config": "per-layer overrides (Gemma-4 style)",
  "alibi": "ALiBi instead of RoPE (Falcon style)",
}
_ROPE_KEYS = (
  "rope_theta",
  "rope_parameters",
  "rope_scaling",
  "rotary_emb_base",
  "rotary_dim",
  "partial_rotary_factor",
)


def refuse_unverified(
  model_type: Any,
  cfg: Mapping[str, Any],
  params: Mapping[str, Any],
  *,
  layout: Any,
  rotated_slice: Any,
  rotary_dim: Any,
) -> None:
  """Raises ``UnverifiedFamilyError`` for a family outside ``VERIFIED_FAMILIES``: first for a config
  key whose meaning is family-specific (``FAMILY_SPECIFIC_KEYS``, named), then unless the caller
  stated what jaxpe cannot read from the config: ``layout`` and ``rotated_slice`` always,
  ``rotary_dim`` unless the config states ``partial_rotary_factor`` (a config.json leaves out its
  class's defaults, and a remote-code config class may spell its share otherwise).
  """
  name = f"model_type {model_type!r}" if model_type else "a config without model_type"
  for key, meaning in FAMILY_SPECIFIC_KEYS.items():
    value = cfg.get(key, params.get(key))
    if value is not None and not (key == "alibi" and value is False):
      raise UnverifiedFamilyError(
        f"{name} is not a family jaxpe has verified (transformers {TRANSFORMERS_VERSION}, "
        f"jaxpe.ops.hf_verified), and its config has {key!r} ({meaning}); what that key does is the "
        "family's, so rope_from_hf_config does not read it: build the rotary embedding from "
        "jaxpe.rope_frequencies(...) and jaxpe.apply_rope(...), checked against the family's own code"
      )
  partial_stated = (
    params.get("partial_rotary_factor") is not None or cfg.get("partial_rotary_factor") is not None
  )
  missing = [k for k, v in (("layout", layout), ("rotated_slice", rotated_slice)) if v is None]
  if not partial_stated and rotary_dim is None:
    missing.append("rotary_dim")
  if not missing:
    return
  no_rope = ""
  if not any(cfg.get(k) is not None for k in _ROPE_KEYS):
    no_rope = (
      " Its config has none of the rotary keys (" + ", ".join(_ROPE_KEYS[:3]) + "): the model may have "
      "no rotary embedding at all (learned, ALiBi or no positions)."
    )
  hints = {
    "layout": "layout='half' if its rotate_half is cat((-x2, x1)) of the head's two halves, 'interleaved' if it "
    "rotates pairs (2i, 2i + 1) (x[..., ::2] / x[..., 1::2], rotate_every_two, repeat_interleave of the "
    "table, complex multiplication)",
    "rotated_slice": "rotated_slice='leading' if the first R dims of each q/k head rotate, 'trailing' if the "
    "last R do (latent-attention heads [nope | rope])",
    "rotary_dim": "rotary_dim=R, the dims per head that rotate (the config states no partial_rotary_factor)",
  }
  raise UnverifiedFamilyError(
    f"{name} is not a family jaxpe has verified against transformers' modeling code (transformers "
    f"{TRANSFORMERS_VERSION}, jaxpe.ops.hf_verified): pass {', '.join(k + '=' for k in missing)} as its "
    f"rotary code does it.{no_rope} Read them off its apply_rotary_pos_emb (transformers/models/<family>/"
    "modeling_<family>.py, or the model's remote code): " + "; ".join(hints[k] for k in missing) + ". Then "
    "check r.apply(q, positions) against that function as docs/rope.md shows ('Families jaxpe has not verified')."
  )
