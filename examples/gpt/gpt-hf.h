/* gpt-hf.h - the reference GPT as Hugging Face's GPT-2 (transformers' GPT2LMHeadModel):
 * its model.safetensors and the config.json beside it, read and written.
 *
 * The two models compute the same function: learned positions, pre-LayerNorm blocks with
 * eps 1e-5, biases on every projection, GELU's tanh approximation (HF's "gelu_new"),
 * attention scaled by 1/sqrt(head size), and the head tied to wte (tie_embeddings). What
 * differs is the layout: HF's projections are Conv1D, whose weights are stored [in, out]
 * where ours (nn.Linear's) are [out, in], so they are transposed on the way in and out.
 * A config.json whose model computes something else (another activation, another eps,
 * unscaled attention) is refused, naming the field. */
#ifndef RTP_GPT_HF_H
#define RTP_GPT_HF_H

#include "gpt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether the opened file is HF's GPT-2 (with or without the "transformer." prefix that
 * GPT2LMHeadModel adds to GPT2Model's names): its first block's c_attn weight is [d, 3d]. */
bool gpt_hf_detect(const struct rtp_safetensors *st);

/* The config of the HF model in st, opened from path: vocab, n_positions (seq_len), d_model
 * and n_layer from the tensors' shapes; n_head, which no shape shows, from path's
 * directory's config.json, else from n_head (> 0: the caller's; -1: none, an error that
 * says so); tied unless config.json says tie_word_embeddings false or, without one, the
 * file has an lm_head.weight. Every tensor must be one of the model's (HF's attn.bias and
 * attn.masked_bias buffers are skipped). 0, or RTP_EINVAL / RTP_EFORMAT with
 * gpt_hf_error() saying why. */
int gpt_hf_config(const char *path, const struct rtp_safetensors *st, int n_head,
                  struct gpt_config *c);

/* Parameter p of a model of config c (named and shaped as gpt_build makes it) read whole
 * into full (its element count) from the HF file: Conv1D weights transposed, and the first
 * c.seq_len positions of wpe (seq_len may be below the file's n_positions). */
int gpt_hf_read(struct rtp_safetensors *st, const struct rtp_tensor *p, float *full);

/* Writes the whole parameters t[0, n) of a model of config c (gpt_build's names and
 * shapes, with data) as HF's GPT-2: path (safetensors, atomically) and config.json in
 * path's directory, which GPT2LMHeadModel.from_pretrained(directory) loads. */
int gpt_hf_save(const char *path, struct gpt_config c, struct rtp_tensor *const *t, int n);

/* The message of the last failure of these functions on this thread. */
const char *gpt_hf_error(void);

#ifdef __cplusplus
}
#endif

#endif
