"""The part of every attention processor around the attention itself, as diffusers' AttnProcessor does it. Its own
module so that the processors of backends.py and fused.py share it without importing each other."""
from __future__ import annotations


class Processor:
    """Everything diffusers' AttnProcessor does around attention: spatial norm, 4-D inputs, mask preparation, group
    norm, norm_cross, output projection and dropout, residual, rescale. Subclasses implement attend()."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)  # (B, Tq, C)
        batch, tokens_k, _ = (hidden_states if encoder_hidden_states is None else encoder_hidden_states).shape
        attention_mask = attn.prepare_attention_mask(attention_mask, tokens_k, batch)  # (n, 1 or Tq, Tk) or None
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        hidden_states = self.attend(attn, hidden_states, encoder_hidden_states, attention_mask)  # (B, Tq, C)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor
