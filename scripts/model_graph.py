"""Graph rewrites of the packaged all-MiniLM-L6-v2, before quantisation (scripts/build_model.py).

The source model is sha256-pinned, so its names are known: layer N's attention is
`inner.encoder.layer.N.attention.*`. The rewrites give the same vectors up to float rounding
(cosine 0.9999 to the unrewritten graph), alone or in a batch (tests/unit/embedding/test_embedding.py):

`rewrite` runs them in turn:

1. `fuse_attention`: each layer's attention (reshapes, transposes, the two scalings, the mask's
   Where, softmax, the NaN guard, two MatMuls: ~20 nodes) becomes one
   com.microsoft.MultiHeadAttention over the projected Q, K and V, with the attention mask as its
   key padding mask. onnxruntime's own fusions do not match this export's pattern. The export
   scales Q and K each by 32^-1/4; MultiHeadAttention scales their product by 1/sqrt(32), the
   same. Masked keys get -3.4e38 there and -10000 here: both exp to exactly 0 in fp32.
2. `merge_qkv`: a layer's three projections become one MatMul over their weights side by side,
   then a Split, so quantisation makes one MatMulNBits of them instead of three.
3. `fuse_gelu`: the erf form of GELU (Div, Erf, Add, Mul, Mul) becomes one com.microsoft Gelu,
   with onnxruntime.transformers' own fusion (onnxruntime's load-time fusions miss it here).

4. `expose_states`: the token states after the first STATES_LAYERS layers (the layer the verifier
   was trained on) become a second graph output, STATES_OUTPUT (an Identity of that layer's
   output LayerNorm): the semantic verifier aligns them (sidecar/cache/alignment.py), and fetching them from the run that makes
   the vector costs a copy, not a second run.

On the 2-core machine 1 and 2 took a 10-token text from 2.46 to 2.15 ms and a 42-token one from
8.5 to 7.3 ms (p50, 2 threads), 3 another ~4% on the 42-token one; graph nodes 255 -> 111.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sidecar.cache.alignment import STATES_LAYERS
from sidecar.embedding.encoder import STATES_OUTPUT

LAYERS = 6
HEADS = 12
_PREFIX = "inner.encoder.layer.{layer}.attention."
_MASK = "sluice_key_padding_mask"


def _is_weight(name: str) -> bool:
    return name.startswith("inner.")


def _add_of_bias(graph: onnx.GraphProto, bias: str) -> onnx.NodeProto:
    node = next((n for n in graph.node if n.op_type == "Add" and bias in n.input), None)
    if node is None:
        raise ValueError(f"no Add of {bias}: not the pinned source model's graph")
    return node


def _data_input(node: onnx.NodeProto) -> str:
    """The input of an Add or MatMul that is not one of the model's named weights."""
    name = next((name for name in node.input if not _is_weight(name)), None)
    if name is None:
        raise ValueError(f"{node.name}: no data input: not the pinned source model's graph")
    return name


def _producer(producers: dict[str, onnx.NodeProto], name: str) -> onnx.NodeProto:
    if name not in producers:
        raise ValueError(f"nothing produces {name}: not the pinned source model's graph")
    return producers[name]


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """The node that produces each output name, as the graph stands now."""
    return {output: node for node in graph.node for output in node.output}


def _qkv_adds(graph: onnx.GraphProto, prefix: str) -> list[onnx.NodeProto]:
    """A layer's query, key and value bias Adds, in that order."""
    return [_add_of_bias(graph, f"{prefix}self.{x}.bias") for x in ("query", "key", "value")]


def fuse_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    producer = _producers(graph)
    fused = [helper.make_node("Cast", ["attention_mask"], [_MASK], to=TensorProto.INT32,
                              name="sluice_mask_int32")]
    for layer in range(LAYERS):
        prefix = _PREFIX.format(layer=layer)
        q, k, v = (add.output[0] for add in _qkv_adds(graph, prefix))
        projection = _producer(producer, _data_input(_add_of_bias(graph, f"{prefix}output.dense.bias")))
        if projection.op_type != "MatMul":
            raise ValueError(f"layer {layer}: expected the output projection's MatMul, got {projection.op_type}")
        context = f"sluice_attention_{layer}"
        fused.append(helper.make_node("MultiHeadAttention", [q, k, v, "", _MASK], [context],
                                      domain="com.microsoft", num_heads=HEADS, name=f"sluice_mha_{layer}"))
        projection.input[0] = context
    graph.node.extend(fused)     # the old attention nodes are dead now: `rewrite` drops them
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def merge_qkv(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    producer = _producers(graph)
    weights = {tensor.name: tensor for tensor in graph.initializer}
    for layer in range(LAYERS):
        prefix = _PREFIX.format(layer=layer)
        adds = _qkv_adds(graph, prefix)
        matmuls = [_producer(producer, _data_input(add)) for add in adds]
        if any(m.op_type != "MatMul" for m in matmuls) or len({m.input[0] for m in matmuls}) != 1:
            raise ValueError(f"layer {layer}: Q, K and V are not three MatMuls of one input")
        arrays = [numpy_helper.to_array(weights[m.input[1]]) for m in matmuls]
        merged = numpy_helper.from_array(np.concatenate(arrays, axis=1), f"sluice_qkv_weight_{layer}")
        sizes = numpy_helper.from_array(np.array([a.shape[1] for a in arrays], dtype=np.int64),
                                        f"sluice_qkv_sizes_{layer}")
        graph.initializer.extend([merged, sizes])
        # The merged MatMul takes the place of the earliest of the three (their input is ready
        # there, and every Add comes later).
        position = {id(node): index for index, node in enumerate(graph.node)}
        first = min(matmuls, key=lambda node: position[id(node)])
        first.input[1], first.output[0] = merged.name, f"sluice_qkv_{layer}"
        split = helper.make_node("Split", [first.output[0], sizes.name],
                                 [f"sluice_{x}_{layer}" for x in "qkv"], axis=-1, name=f"sluice_split_{layer}")
        for add, new in zip(adds, split.output):
            add.input[list(add.input).index(_data_input(add))] = new
        for matmul in matmuls:
            if matmul is not first:
                graph.node.remove(matmul)
        graph.node.insert(list(graph.node).index(first) + 1, split)
    return model


def fuse_gelu(model) -> None:
    """model: onnxruntime.transformers' OnnxModel, changed in place."""
    from onnxruntime.transformers.fusion_gelu import FusionGelu

    FusionGelu(model).apply()
    if sum(node.op_type == "Gelu" for node in model.model.graph.node) != LAYERS:
        raise ValueError("expected one GELU per layer to fuse")


def expose_states(model: onnx.ModelProto, layers: int) -> onnx.ModelProto:
    """Adds STATES_OUTPUT: [batch, sequence, 384] float32, the output of layer `layers` - 1."""
    graph = model.graph
    weight = f"inner.encoder.layer.{layers - 1}.output.LayerNorm.weight"
    norm = next((n for n in graph.node if n.op_type == "LayerNormalization" and weight in n.input), None)
    if norm is None:
        raise ValueError(f"no LayerNormalization of {weight}: not the pinned source model's graph")
    graph.node.append(helper.make_node("Identity", [norm.output[0]], [STATES_OUTPUT], name="sluice_token_states"))
    graph.output.append(helper.make_tensor_value_info(STATES_OUTPUT, TensorProto.FLOAT, ["batch", "sequence", 384]))
    return model


def rewrite(model: onnx.ModelProto, states_layers: int = STATES_LAYERS) -> onnx.ModelProto:
    """The four rewrites, then one clean-up by onnxruntime.transformers: nodes and
    initializers nothing uses any more dropped, the rest in topological order."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    for name in ("fusion_base", "onnxruntime.transformers.onnx_model"):   # lines per step otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    wrapped = OnnxModel(expose_states(merge_qkv(fuse_attention(model)), states_layers))
    fuse_gelu(wrapped)
    wrapped.prune_graph()
    wrapped.topological_sort()
    return wrapped.model
