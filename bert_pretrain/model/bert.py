"""`BertModel` (embeddings + encoder + pooler) and `BertForPreTraining` (+ MLM and NSP heads and
their losses), state-dict compatible with transformers' classes of the same names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import BertConfig, ModelImpl
from .encoder import BertEmbeddings, BertEncoder, BertPooler, add_unused_position_table
from .heads import BertLMPredictionHead, BertPreTrainingHeads, ReplacedTokenHead
from .layout import QuerySubset, TokenLayout

IGNORE_INDEX = -100


@dataclass
class PreTrainingOutput:
    loss: torch.Tensor | None = None
    """mlm_loss + nsp_loss (those that were given labels; + rtd_loss, unweighted, with a
    generator); None without labels."""
    mlm_loss: torch.Tensor | None = None
    """Cross-entropy over the labelled positions (labels != -100): their mean, or their sum
    with `loss_reduction="sum"`."""
    nsp_loss: torch.Tensor | None = None
    """Cross-entropy over the sequences: mean, or sum with `loss_reduction="sum"`."""
    prediction_logits: torch.Tensor | None = None
    """[B, L, V]; with `impl.sparse_prediction` and labels: [M, V] for the M labelled
    positions, in row-major (batch, position) order, aligned with `mlm_labels`. Dense logits at
    padding positions mean nothing (with `impl.unpad` they come from zero hidden states)."""
    mlm_labels: torch.Tensor | None = None
    """[M] labels of the sparse logits rows; None when the logits are dense."""
    seq_relationship_logits: torch.Tensor | None = None
    """[B, 2]; None for an MLM-only model (`next_sentence_prediction=False`)."""
    hidden_states: tuple[torch.Tensor, ...] | None = None
    """Embedding output + each layer's output, [B, L, H] each (zeros at padding if unpadded)."""
    attentions: tuple[torch.Tensor, ...] | None = None
    """Per layer [B, heads, L, L] attention probabilities."""
    rtd_loss: torch.Tensor | None = None
    """Replaced-token detection (`generator_layers > 0`, with labels): binary cross-entropy of
    the encoder's per-token logits over the real tokens, mean or sum as `loss_reduction`."""
    rtd_logits: torch.Tensor | None = None
    """[N] the encoder's "replaced" logits at the real tokens, in row-major order."""
    rtd_labels: torch.Tensor | None = None
    """[N] 1.0 where the generator's sample differs from the original token, else 0.0."""


def labelled_rows(flat_labels: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Indices of the labels that are not -100, in order. With `count` (exact, known on the
    host) the output size is given, so a GPU need not report it back (torch >= 2.6 has this on
    CUDA; older builds fall back to the plain gather)."""
    return _rows(flat_labels != IGNORE_INDEX, count,
                 lambda n: f"num_labelled={count}, but the labels hold {n} that are not -100")


def _rows(selected: torch.Tensor, count: int | None, mismatch) -> torch.Tensor:
    """Indices where the bool vector `selected` holds, at the size `count` where given."""
    if count is not None:
        if selected.device.type == "cpu" and int(selected.sum()) != count:
            # (checked where it costs no wait: a wrong count would drop or repeat rows)
            raise ValueError(mismatch(int(selected.sum())))
        try:
            return torch.nonzero_static(selected, size=count).squeeze(1)
        except NotImplementedError:  # no kernel for this device in this torch build
            pass
    return selected.nonzero().squeeze(1)


def init_bert_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation (truncation aside, as transformers): N(0, std) weights, zero
    biases, unit LayerNorms, zero row for the padding embedding."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, BertLMPredictionHead):
        nn.init.zeros_(module.bias)


@dataclass
class EncoderOutput:
    sequence_output: torch.Tensor
    """[B, L, H] on the padded grid, [N, H] when `layout.unpadded`, or [R, H] for `rows`."""
    pooled_output: torch.Tensor | None
    """[B, H]; None for an MLM-only model (no pooler)."""
    layout: TokenLayout
    rows: torch.Tensor | None = None
    """[R] indices into the layout's token order of the rows in `sequence_output` (when `keep`
    was given), else None."""
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class BertModel(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl | None = None):
        super().__init__()
        self.config = config
        self.impl = impl or ModelImpl()
        self.embeddings = BertEmbeddings(config, self.impl)
        self.encoder = BertEncoder(config, self.impl)
        # The pooler exists for the NSP head only: an MLM-only model has none (as transformers'
        # BertForMaskedLM), so no parameter sits outside what its loss reaches.
        self.pooler = BertPooler(config) if config.next_sentence_prediction else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None,
                output_attentions=False, output_hidden_states=False,
                keep: torch.Tensor | None = None) -> EncoderOutput:
        """`keep` ([B, L] bool): only these positions (and each first token) are needed from
        the last layer, which then computes just those rows. Ignored when hidden states or
        attention maps are requested (they cover every position)."""
        b, n = input_ids.shape
        layout = TokenLayout.build(attention_mask, b, n,
                                    self.impl.resolved_unpad(input_ids.device.type))
        subset = None
        if keep is not None and not (output_attentions or output_hidden_states):
            subset = QuerySubset.build(keep, layout)
        x = self.embeddings(input_ids, token_type_ids, layout)
        x, hidden_states, attentions = self.encoder(x, layout, output_attentions,
                                                    output_hidden_states, subset)
        pooled = None if self.pooler is None else self.pooler(x, layout, subset)
        if hidden_states is not None:
            hidden_states = tuple(layout.to_grid(h) for h in hidden_states)
        if attentions is not None:
            attentions = tuple(attentions)
        return EncoderOutput(x, pooled, layout, None if subset is None else subset.rows,
                             hidden_states, attentions)


class BertForPreTraining(nn.Module):
    """BERT with its pretraining heads; with `config.next_sentence_prediction=False` the MLM
    head alone (the state dict of transformers' BertForMaskedLM)."""

    def __init__(self, config: BertConfig, impl: ModelImpl | None = None):
        super().__init__()
        self.config = config
        self.impl = impl or ModelImpl()
        self.bert = BertModel(config, self.impl)
        self.cls = BertPreTrainingHeads(config, self.bert.embeddings.word_embeddings)
        self.generator = self.discriminator_predictions = None
        if config.generator_layers:
            # ELECTRA with tied embeddings: the generator reads the same embedding layer and owns
            # the MLM head (tied to the word embeddings); it is narrower than the encoder by
            # depth rather than width, so that the whole embedding layer can be shared.
            self.generator = BertEncoder(
                dataclasses.replace(config, num_hidden_layers=config.generator_layers),
                self.impl)
            self.discriminator_predictions = ReplacedTokenHead(config)
        for module in self.modules():
            # The decoder's weight is the word-embedding matrix, initialised (with its zero
            # padding row) as an embedding; initialising it again as a Linear would undo that.
            if module is not self.cls.predictions.decoder:
                init_bert_weights(module, config.initializer_range)

    def set_attention_locality(self, slopes) -> None:
        """Add -slopes[h] * |i - j| to head h's attention scores in every layer (ALiBi's form;
        not to the first position's, [CLS]'s, which keeps reading the whole input for NSP), or
        nothing with None / all zeros (BERT).  A training-time aid: a BERT trained from
        scratch spends its first thousands of steps predicting only frequent tokens, because no
        head attends to the neighbours a masked token is read from until attention and values
        have learned it together; a local start breaks that tie, and once the bias is faded out
        the weights are a plain BERT's (docs/learning-check.md).  Not saved in checkpoints:
        the trainer sets it each step."""
        tensor = None
        if slopes is not None and any(float(x) != 0.0 for x in slopes):
            if len(slopes) != self.config.num_attention_heads:
                raise ValueError(f"attention locality needs one slope per head "
                                 f"({self.config.num_attention_heads}), got {len(slopes)}")
            tensor = torch.tensor([float(x) for x in slopes], dtype=torch.float32)
        layers = list(self.bert.encoder.layer)
        if self.generator is not None:
            # the generator learns the masked-LM from scratch too: the same stall, the same aid
            layers += list(self.generator.layer)
        for layer in layers:
            layer.attention.self.locality_slopes = tensor

    def hf_state_dict(self) -> dict:
        """The state dict with transformers' key set (relative position types: plus the
        absolute table transformers 4.x holds and never reads, as zeros; see
        `add_unused_position_table`). load_state_dict accepts either form."""
        return add_unused_position_table(self.state_dict(), self.config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None,
                output_attentions: bool = False,
                output_hidden_states: bool = False,
                loss_reduction: str = "mean",
                num_labelled: int | None = None,
                num_real: int | None = None) -> PreTrainingOutput:
        """`loss_reduction="sum"` returns summed token / sequence losses, so that a trainer can
        normalise by the counts of a whole global batch rather than of this micro-batch.
        Without `next_sentence_label` there is no NSP loss (`nsp_loss` is None); an MLM-only
        model refuses one. `num_labelled`: how many labels are not -100, where the caller
        knows it on the host (a trainer counts its batch before copying it): the labelled rows
        are then gathered without asking the device how many there are, which on a GPU is a
        wait for all the work queued before it. It must be exact. `num_real`, the same for the
        real (not padding) tokens: ELECTRA's detection loss is over those."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be mean or sum, got {loss_reduction!r}")
        if self.generator is not None:
            return self._replaced_token_forward(input_ids, attention_mask, token_type_ids, labels,
                                                next_sentence_label, output_attentions,
                                                output_hidden_states, loss_reduction,
                                                num_labelled, num_real)
        sparse = self.impl.sparse_prediction and labels is not None
        keep = None
        if sparse and self.impl.resolved_sparse_last_layer(input_ids.device.type):
            keep = labels != IGNORE_INDEX
        enc = self.bert(input_ids, attention_mask, token_type_ids, output_attentions,
                        output_hidden_states, keep)
        seq, layout = enc.sequence_output, enc.layout
        heads = self.cls
        mlm_labels = None
        if sparse:
            # Only ~15% of positions carry a label: run the transform and the V-way projection on
            # those rows alone. (Labels on padding positions are not supported when unpadded.)
            flat_labels = layout.select(labels)
            if enc.rows is not None:
                flat_labels = flat_labels.index_select(0, enc.rows)
            rows = labelled_rows(flat_labels, num_labelled)
            mlm_labels = flat_labels.index_select(0, rows)
            logits = heads.predictions(seq.reshape(-1, seq.shape[-1]).index_select(0, rows))
        else:
            logits = heads.predictions(layout.to_grid(seq))
        nsp_logits, nsp_loss = self._nsp(enc, next_sentence_label, loss_reduction)

        mlm_loss = loss = None
        if labels is not None:
            if sparse:
                mlm_loss = F.cross_entropy(logits.float(), mlm_labels, reduction=loss_reduction)
            else:
                # Dense logits, loss over the labelled rows alone: cross-entropy over all B*L
                # rows with ignore_index made an fp32 copy of the whole [B*L, V] logits plus its
                # log-softmax and gradient (3 x 4 GB at BERT-base b256 L128), where ~15% of the
                # rows count.  Same value (the mean over the labelled rows).
                flat_labels = labels.reshape(-1)
                rows = labelled_rows(flat_labels, num_labelled)
                mlm_loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).index_select(0, rows).float(),
                    flat_labels.index_select(0, rows), reduction=loss_reduction)
            loss = mlm_loss
        if nsp_loss is not None:
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, logits, mlm_labels, nsp_logits,
                                 enc.hidden_states, enc.attentions)

    def _nsp(self, enc: EncoderOutput, next_sentence_label, loss_reduction):
        """(NSP logits or None, NSP loss or None)."""
        if self.cls.seq_relationship is None:
            if next_sentence_label is not None:
                raise ValueError("this model has no NSP head (model.next_sentence_prediction="
                                 "false): pass no next_sentence_label")
            return None, None
        logits = self.cls.seq_relationship(enc.pooled_output)
        loss = None
        if next_sentence_label is not None:
            loss = F.cross_entropy(logits.float(), next_sentence_label.reshape(-1),
                                   reduction=loss_reduction)
        return logits, loss

    def _replaced_token_forward(self, input_ids, attention_mask, token_type_ids, labels,
                                next_sentence_label, output_attentions, output_hidden_states,
                                loss_reduction, num_labelled=None,
                                num_real=None) -> PreTrainingOutput:
        """ELECTRA: the generator predicts the masked tokens (MLM loss, its `prediction_logits`
        sparse over the labelled rows as `impl.sparse_prediction`'s); a token sampled from each
        prediction replaces the input there; the encoder reads the result and scores every real
        token "replaced or not" (a sample equal to the original counts as not replaced). No
        gradient flows through the sampling: the generator learns from its MLM loss alone, the
        encoder from the detection loss alone, the shared embeddings from both. The sampling
        draws from torch's global generator (the trainer seeds it per micro-batch). Without
        labels (fill-mask): the generator's dense logits, and the encoder on the input as it
        is."""
        b, n = input_ids.shape
        layout = TokenLayout.build(attention_mask, b, n,
                                    self.impl.resolved_unpad(input_ids.device.type))
        gen, _, _ = self.generator(self.bert.embeddings(input_ids, token_type_ids, layout), layout)
        if labels is None:
            enc = self.bert(input_ids, attention_mask, token_type_ids, output_attentions,
                            output_hidden_states)
            nsp_logits, _ = self._nsp(enc, next_sentence_label, loss_reduction)
            return PreTrainingOutput(prediction_logits=self.cls.predictions(layout.to_grid(gen)),
                                     seq_relationship_logits=nsp_logits,
                                     hidden_states=enc.hidden_states, attentions=enc.attentions)
        flat_labels = layout.select(labels)
        rows = labelled_rows(flat_labels, num_labelled)
        mlm_labels = flat_labels.index_select(0, rows)
        logits = self.cls.predictions(gen.reshape(-1, gen.shape[-1]).index_select(0, rows))
        mlm_loss = F.cross_entropy(logits.float(), mlm_labels, reduction=loss_reduction)
        with torch.no_grad():
            # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
            noise = torch.rand(logits.shape, device=logits.device).clamp_(1e-9, 1.0)
            sampled = (logits.float() - torch.log(-torch.log(noise))).argmax(-1)
            labelled = labels != IGNORE_INDEX
            # (masked_scatter fills in row-major order: the order of `rows`)
            corrupted = input_ids.masked_scatter(labelled, sampled.to(input_ids.dtype))
            replaced = corrupted != torch.where(labelled, labels, input_ids)
        enc = self.bert(corrupted, attention_mask, token_type_ids, output_attentions,
                        output_hidden_states)
        rtd_logits = self.discriminator_predictions(enc.sequence_output).reshape(-1)
        rtd_labels = enc.layout.select(replaced).float()
        if not enc.layout.unpadded and attention_mask is not None:
            real = _rows(attention_mask.reshape(-1).bool(), num_real,
                         lambda n: f"num_real={num_real}, but the attention mask holds {n} "
                                   f"real tokens")
            rtd_logits, rtd_labels = rtd_logits.index_select(0, real), \
                rtd_labels.index_select(0, real)
        rtd_loss = F.binary_cross_entropy_with_logits(rtd_logits.float(), rtd_labels,
                                                      reduction=loss_reduction)
        nsp_logits, nsp_loss = self._nsp(enc, next_sentence_label, loss_reduction)
        loss = mlm_loss + rtd_loss + (0 if nsp_loss is None else nsp_loss)
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, logits, mlm_labels, nsp_logits,
                                 enc.hidden_states, enc.attentions, rtd_loss, rtd_logits,
                                 rtd_labels)
