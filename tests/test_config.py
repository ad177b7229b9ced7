"""Network configs: the YAML format, the shipped configs' shapes, and the error messages."""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from mucudnn.config import ConfigLayer, NetworkConfig, find_config, list_configs, load_config
from mucudnn.errors import ConfigError
from mucudnn.problem import ConvProblem, DataType, Direction, MathType

REPO = Path(__file__).resolve().parents[1]
BAD_CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
SHIPPED = ("alexnet", "deepbench", "resnet18", "resnet50", "vgg16")
ALL_DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD_DATA, Direction.BACKWARD_FILTER)
NO_INPUT_GRADIENT = (Direction.FORWARD, Direction.BACKWARD_FILTER)


def shipped(name: str) -> NetworkConfig:
    return load_config(find_config(name))


def write_config(tmp_path: Path, text: str, name: str = "net.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def expanded(config: NetworkConfig) -> list[ConvProblem]:
    """The forward problem of every convolution layer, each repeat listed."""
    return [layer.problem for layer in config.layers for _ in range(layer.count)]


def conv_weights(config: NetworkConfig) -> int:
    """Filter elements of all layers (biases excluded)."""
    return sum(math.prod(problem.w_shape) for problem in expanded(config))


def load_generator():
    spec = importlib.util.spec_from_file_location("configs_generate", REPO / "configs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


# -- the shipped configs --------------------------------------------------------------------------

def test_the_expected_configs_are_shipped():
    assert set(SHIPPED) <= set(list_configs())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_and_is_named_after_its_file(name):
    config = shipped(name)
    assert config.name == name
    assert config.path.stem == name
    assert config.layers and config.kernels()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_also_in_the_package_data(name):
    # An installed (non-editable) mucudnn finds its configs in mucudnn/data/configs.
    packaged = REPO / "mucudnn" / "data" / "configs" / f"{name}.yaml"
    assert packaged.read_bytes() == (REPO / "configs" / f"{name}.yaml").read_bytes()


def test_generated_configs_are_what_the_generator_writes():
    generator = load_generator()
    for network in generator.NETWORKS:
        committed = (REPO / "configs" / f"{network.name}.yaml").read_text(encoding="utf-8")
        assert committed == generator.render(network), f"rerun configs/generate.py ({network.name})"


@pytest.mark.parametrize("name", ["alexnet", "resnet18", "resnet50", "vgg16"])
def test_first_layer_computes_no_input_gradient(name):
    layers = shipped(name).layers
    assert layers[0].directions == NO_INPUT_GRADIENT
    assert all(layer.directions == ALL_DIRECTIONS for layer in layers[1:])


@pytest.mark.parametrize("name", ["alexnet", "resnet18", "resnet50", "vgg16"])
def test_networks_run_at_batch_256_in_fp32(name):
    config = shipped(name)
    assert config.batch == 256
    for layer in config.layers:
        assert layer.problem.n == 256
        assert (layer.problem.dtype, layer.problem.compute_type) == (DataType.FLOAT, DataType.FLOAT)
        assert layer.problem.math is MathType.FMA


def test_alexnet_matches_caffe_bvlc_alexnet():
    problems = expanded(shipped("alexnet"))
    assert [p.input_size[0] for p in problems] == [227, 27, 13, 13, 13]
    assert [p.output_size for p in problems] == [(55, 55), (27, 27), (13, 13), (13, 13), (13, 13)]
    assert [p.k for p in problems] == [96, 256, 384, 384, 256]
    assert [p.groups for p in problems] == [1, 2, 1, 2, 2]
    assert [p.filter_size[0] for p in problems] == [11, 5, 3, 3, 3]
    # Each layer consumes the previous one's channels; pool1 and pool2 (3x3 s2, Caffe rounds up)
    # take 55 -> 27 and 27 -> 13.
    assert all(later.c == earlier.k for earlier, later in itertools.pairwise(problems))
    assert math.ceil((55 - 3) / 2) + 1 == 27 and math.ceil((27 - 3) / 2) + 1 == 13
    # bvlc_alexnet has 60,965,224 parameters; its three fully connected layers hold
    # 9216*4096+4096 + 4096*4096+4096 + 4096*1000+1000 of them and the conv biases 1376.
    fully_connected = (9216 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * 1000 + 1000)
    assert conv_weights(shipped("alexnet")) == 60_965_224 - fully_connected - 1376


def test_resnet50_has_53_convs_at_the_published_sizes():
    config = shipped("resnet50")
    problems = expanded(config)
    assert config.layer_count == len(problems) == 53  # 1 + 16 bottlenecks x 3 + 4 downsample
    assert {p.output_size for p in problems} == {(s, s) for s in (112, 56, 28, 14, 7)}
    assert Counter(p.filter_size for p in problems) == {(7, 7): 1, (3, 3): 16, (1, 1): 36}
    # v1.5: the stride sits on the 3x3 conv of each stage's first block (3), plus conv1 and the
    # 3 stride-2 downsample convs.
    strided = Counter(p.filter_size for p in problems if p.stride == (2, 2))
    assert strided == {(7, 7): 1, (3, 3): 3, (1, 1): 3}
    # torchvision's resnet50 has 25,557,032 parameters: fc 2048*1000+1000, and batch norms with
    # 2 x 26,560 (their channels summed).
    assert conv_weights(config) == 25_557_032 - (2048 * 1000 + 1000) - 2 * 26_560


def test_resnet18_has_20_convs():
    config = shipped("resnet18")
    problems = expanded(config)
    assert config.layer_count == 20  # 1 + 8 basic blocks x 2 + 3 downsample
    assert {p.output_size for p in problems} == {(s, s) for s in (112, 56, 28, 14, 7)}
    assert Counter(p.filter_size for p in problems) == {(7, 7): 1, (3, 3): 16, (1, 1): 3}
    # torchvision's resnet18 has 11,689,512 parameters: fc 512*1000+1000, batch norms 2 x 4800.
    assert conv_weights(config) == 11_689_512 - (512 * 1000 + 1000) - 2 * 4800


def test_vgg16_has_13_convs():
    config = shipped("vgg16")
    problems = expanded(config)
    assert config.layer_count == 13
    assert [p.input_size[0] for p in problems] == [224] * 2 + [112] * 2 + [56] * 3 + [28] * 3 \
        + [14] * 3
    assert all(p.filter_size == (3, 3) and p.padding == (1, 1) for p in problems)
    assert all(p.output_size == p.input_size for p in problems)
    # torchvision's vgg16 convs hold 14,714,688 parameters, 4224 of them biases (sum of k).
    assert conv_weights(config) == 14_714_688 - sum(p.k for p in problems)


def test_deepbench_has_the_94_training_problems_with_their_own_batch():
    config = shipped("deepbench")
    assert config.batch is None
    assert len(config.layers) == config.layer_count == 94
    assert {layer.problem.n for layer in config.layers} == {4, 8, 16, 32}
    assert all(layer.directions == ALL_DIRECTIONS for layer in config.layers)
    # Four problems occur twice in DeepBench's list: their kernels merge with weight 2.
    weights = Counter(weight for _, weight in config.kernels())
    assert weights == {1: 3 * (94 - 2 * 4), 2: 3 * 4}


def test_deepbench_names_agree_with_the_shapes():
    for layer in shipped("deepbench").layers:
        fields = re.fullmatch(r"db\d{3}_w(\d+)_h(\d+)_c(\d+)_n(\d+)_k(\d+)", layer.name)
        assert fields, layer.name
        w, h, c, n, k = map(int, fields.groups())
        p = layer.problem
        assert (p.input_size, p.c, p.n, p.k) == ((h, w), c, n, k), layer.name


def test_deepbench_height_and_width_are_not_swapped():
    # The DeepSpeech problems chain: db001 (700x161 spectrogram) produces db005's 341x79 input.
    layers = {layer.name.split("_")[0]: layer.problem for layer in shipped("deepbench").layers}
    assert layers["db001"].output_size == layers["db005"].input_size == (79, 341)


# -- cross-check against torchvision (only where torch and torchvision are installed) -------------

def _torchvision_convs(architecture: str) -> list[tuple[str, tuple]]:
    """(module name, geometry) of every Conv2d torchvision's model runs on a 224x224 image."""
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("torchvision.models")
    model = getattr(models, architecture)(weights=None).eval()
    seen: list[tuple[str, tuple]] = []

    def record(name):
        def hook(module, inputs, output):
            seen.append((name, (module.in_channels, tuple(inputs[0].shape[2:]),
                                module.out_channels, module.kernel_size, module.padding,
                                module.stride, module.dilation, module.groups)))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    return seen


def _geometry(problem: ConvProblem) -> tuple:
    return (problem.c, problem.input_size, problem.k, problem.filter_size, problem.padding,
            problem.stride, problem.dilation, problem.groups)


@pytest.mark.parametrize("architecture", ["resnet18", "resnet50", "vgg16"])
def test_configs_match_torchvision(architecture):
    convs = _torchvision_convs(architecture)
    config = shipped(architecture)
    assert Counter(_geometry(p) for p in expanded(config)) == Counter(g for _, g in convs)
    # The generator's module names are torchvision's, in the order torchvision runs them.
    generator = load_generator()
    network = next(n for n in generator.NETWORKS if n.name == architecture)
    assert [conv.name for conv in network.convs()] == [name for name, _ in convs]


# -- the format -----------------------------------------------------------------------------------

def test_identical_layers_merge_into_one_weighted_kernel_in_first_seen_order(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: merge
        batch: 32
        defaults: {directions: [fwd]}
        layers:
          - {name: a, c: 64, in: [28, 28], k: 64, f: 3, pad: 1, count: 2}
          - {name: b, c: 64, in: [28, 28], k: 128, f: 1}
          - {name: c, c: 64, in: [28, 28], k: 64, f: [3, 3], pad: [1, 1], count: 3}
        """))
    kernels = config.kernels()
    assert [(problem.k, weight) for problem, weight in kernels] == [(64, 5), (128, 1)]
    assert kernels[0][0] == config.layers[0].problem
    assert config.layer_count == 6


def test_layers_at_different_batch_sizes_do_not_merge(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: batches
        layers:
          - {name: small, batch: 8, c: 16, in: 14, k: 16, f: 3, directions: [fwd]}
          - {name: large, batch: 16, c: 16, in: 14, k: 16, f: 3, directions: [fwd]}
        """))
    assert [(problem.n, weight) for problem, weight in config.kernels()] == [(8, 1), (16, 1)]


def test_directions_override_merges_only_the_shared_directions(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: directions
        batch: 16
        layers:
          - {name: first, c: 8, in: [16, 16], k: 8, f: 3, pad: 1, directions: [bwd_filter, fwd]}
          - {name: second, c: 8, in: [16, 16], k: 8, f: 3, pad: 1}
        """))
    assert config.layers[0].directions == NO_INPUT_GRADIENT  # canonical order, not as written
    weights = {problem.direction: weight for problem, weight in config.kernels()}
    assert weights == {Direction.FORWARD: 2, Direction.BACKWARD_FILTER: 2,
                       Direction.BACKWARD_DATA: 1}
    assert [problem.direction for problem, _ in config.kernels()] == list(NO_INPUT_GRADIENT) \
        + [Direction.BACKWARD_DATA]


def test_every_kernel_keeps_the_forward_geometry(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: geometry
        batch: 4
        layers:
          - {name: conv, c: 6, in: [20, 30], k: 12, f: [3, 5], pad: [1, 2], stride: [2, 1],
             dilation: [1, 2], groups: 3, mode: conv}
        """))
    (layer,) = config.layers
    assert layer.problem.direction is Direction.FORWARD
    for problem, weight in config.kernels():
        assert weight == 1
        assert problem.with_direction(Direction.FORWARD) == layer.problem
    p = layer.problem
    assert (p.input_size, p.filter_size, p.padding, p.stride, p.dilation, p.groups, p.n) == \
        ((20, 30), (3, 5), (1, 2), (2, 1), (1, 2), 3, 4)
    assert p.mode.value == "conv"


def test_scalar_shorthand_repeats_over_the_spatial_dims(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: shorthand
        batch: 2
        layers:
          - {name: square, c: 4, in: 9, k: 4, f: 3, pad: 1, stride: 2, dilation: 1}
          - {name: volume, c: 4, in: [5, 9, 9], k: 4, f: 3, pad: 1}
        """))
    square, volume = (layer.problem for layer in config.layers)
    assert (square.input_size, square.filter_size, square.padding, square.stride) == \
        ((9, 9), (3, 3), (1, 1), (2, 2))
    assert (volume.input_size, volume.filter_size, volume.padding, volume.dilation) == \
        ((5, 9, 9), (3, 3, 3), (1, 1, 1), (1, 1, 1))


def test_defaults_apply_and_layers_override_them(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: kinds
        batch: 8
        defaults: {dtype: f16, math: tensor_op, layout: nhwc}
        layers:
          - {name: half, c: 8, in: 8, k: 8, f: 1}
          - {name: double, c: 8, in: 8, k: 8, f: 1, dtype: f64, math: default}
          - {name: pseudo, c: 8, in: 8, k: 8, f: 1, compute_type: f16}
        """))
    kinds = [(p.dtype.value, p.compute_type.value, p.math.value, p.layout.value)
             for p in (layer.problem for layer in config.layers)]
    # Without a compute_type, f16 computes in f32 and f64 in f64.
    assert kinds == [("f16", "f32", "tensor_op", "nhwc"), ("f64", "f64", "default", "nhwc"),
                     ("f16", "f16", "tensor_op", "nhwc")]


def test_builtin_defaults_without_a_defaults_section(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: plain
        batch: 1
        layers: [{name: conv, c: 1, in: 4, k: 1, f: 1}]
        """))
    (layer,) = config.layers
    assert layer.directions == ALL_DIRECTIONS and layer.count == 1
    assert layer.problem.key == ("dir=fwd,dt=f32,ct=f32,math=fma,layout=nchw,c=1,in=4x4,k=1,f=1x1,"
                                 "pad=0x0,stride=1x1,dil=1x1,g=1,mode=xcorr")


def test_yaml_merge_keys_share_fields_and_may_be_overridden(tmp_path):
    config = load_config(write_config(tmp_path, """
        name: anchors
        batch: 8
        layers:
          - &block {name: a, c: 16, in: 14, k: 16, f: 3, pad: 1}
          - {<<: *block, name: b, stride: 2}
        """))
    first, second = (layer.problem for layer in config.layers)
    assert second.stride == (2, 2) and second.padding == first.padding == (1, 1)
    assert [layer.name for layer in config.layers] == ["a", "b"]


def test_with_batch_changes_every_layer():
    config = shipped("deepbench").with_batch(64)
    assert config.batch == 64
    assert {layer.problem.n for layer in config.layers} == {64}
    assert {problem.n for problem, _ in config.kernels()} == {64}
    with pytest.raises(ValueError):
        config.with_batch(0)


def test_config_layer_problems_follow_its_directions():
    problem = ConvProblem(Direction.FORWARD, c=2, input_size=(4, 4), k=2, filter_size=(1, 1),
                          padding=(0, 0), stride=(1, 1), dilation=(1, 1))
    layer = ConfigLayer("conv", problem, count=2, directions=NO_INPUT_GRADIENT)
    assert [p.direction for p in layer.problems()] == list(NO_INPUT_GRADIENT)


# -- finding configs ------------------------------------------------------------------------------

def test_find_config_by_name_with_or_without_suffix():
    assert find_config("resnet50") == find_config("resnet50.yaml")
    assert find_config("resnet50").name == "resnet50.yaml"


def test_find_config_prefers_an_existing_path(tmp_path, monkeypatch):
    path = write_config(tmp_path, "name: mine\nlayers: [{name: c, c: 1, in: 2, k: 1, f: 1}]\n",
                        name="resnet50")
    monkeypatch.chdir(tmp_path)
    assert find_config("resnet50") == Path("resnet50")
    assert find_config(path) == path


def test_find_config_names_the_shipped_configs_when_nothing_matches():
    with pytest.raises(ConfigError, match="no config 'resnet51'.*shipped: .*resnet50"):
        find_config("resnet51")


def test_load_config_takes_a_shipped_name_too():
    assert load_config("vgg16") == load_config(REPO / "configs" / "vgg16.yaml")


def test_a_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"no config '{missing}': not a file")):
        load_config(missing)


def test_a_directory_is_not_a_config(tmp_path):
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    with pytest.raises(ConfigError, match="not a file"):
        load_config(directory)


# -- errors ---------------------------------------------------------------------------------------

def check_error(path: Path, *fragments: str) -> str:
    """Loading ``path`` fails with a ConfigError whose message starts with the path and has
    every fragment; returns the message."""
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.mark.parametrize("fixture, fragments", [
    ("missing_field.yaml", [":6: ", "layer 2 (conv2)", "field 'k'", "missing"]),
    ("wrong_type.yaml", [":7: ", "layer 2 (conv2)", "field 'c'", "expected an integer",
                         "text '16'"]),
    ("wrong_length.yaml", [":12: ", "layer 3 (conv3)", "field 'stride'", "expected 2 integers",
                           "got [1]"]),
    ("unknown_field.yaml", [":11: ", "layer 2 (conv2)", "field 'strides'", "unknown field",
                            "did you mean 'stride'?"]),
    ("bad_enum.yaml", [":10: ", "layer 1 (conv1)", "field 'dtype'", "f32, f64, f16, bf16",
                       "got 'f8'"]),
    ("groups_not_dividing.yaml", [":11: ", "layer 2 (conv2)", "field 'groups'", "c=3",
                                  "groups=2"]),
    ("yaml_syntax.yaml", [":7:", "invalid YAML", "flow mapping that began at line 6"]),
    ("empty.yaml", ["the file is empty"]),
])
def test_bad_config_fixture(fixture, fragments):
    check_error(BAD_CONFIGS / fixture, *fragments)


LAYER = "{name: conv1, c: 4, in: [8, 8], k: 4, f: 3}"


@pytest.mark.parametrize("text, fragments", [
    pytest.param(f"name: x\nbatch: 2\nlayers: [{LAYER}]\nstride: 1\n",
                 [":4: ", "field 'stride'", "unknown field"], id="unknown-top-level-field"),
    pytest.param(f"batch: 2\nlayers: [{LAYER}]\n", ["field 'name'", "missing"],
                 id="missing-name"),
    pytest.param("name: x\nbatch: 2\nlayers: []\n",
                 ["field 'layers'", "expected a non-empty list"], id="no-layers"),
    pytest.param(f"name: x\nbatch: 0\nlayers: [{LAYER}]\n",
                 [":2: ", "field 'batch'", "expected an integer >= 1, got 0"], id="zero-batch"),
    pytest.param(f"name: x\nlayers: [{LAYER}]\n",
                 ["layer 1 (conv1)", "field 'batch'", "top-level 'batch'"], id="no-batch"),
    pytest.param(f"- {LAYER}\n", ["expected a mapping", "got a list"], id="not-a-mapping"),
    pytest.param(f"name: x\nbatch: 2\ndefaults: {{math: fast}}\nlayers: [{LAYER}]\n",
                 [":3: ", "defaults", "field 'math'", "got 'fast'"], id="bad-default"),
    pytest.param(f"name: x\nbatch: 2\ndefaults: {{stride: 2}}\nlayers: [{LAYER}]\n",
                 ["defaults", "field 'stride'", "unknown field"], id="not-defaultable"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - conv1\n",
                 [":3: ", "layer 1", "expected a mapping of fields", "text 'conv1'"],
                 id="layer-not-a-mapping"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {c: 4, in: 8, k: 4, f: 3}\n",
                 [":4: ", "layer 1", "field 'name'", "missing"], id="layer-without-name"),
    pytest.param(f"name: x\nbatch: 2\nlayers:\n  - {LAYER}\n  - {LAYER}\n",
                 [":5: ", "layer 2 (conv1)", "field 'name'", "duplicate", "layer 1"],
                 id="duplicate-layer-name"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: 8, k: 4, f: 3, f: 5}\n",
                 [":4:", "duplicate field 'f'"], id="duplicate-field"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: 8, k: 4, f: 3, pad: -1}\n",
                 [":4: ", "layer 1 (a)", "field 'pad'", ">= 0"], id="negative-pad"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: 8, k: 4, f: true}\n",
                 ["layer 1 (a)", "field 'f'", "got True"], id="boolean-size"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: [8, 8, 8, 8], k: 4, f: 3}\n",
                 ["layer 1 (a)", "field 'in'", "2 (H, W) or 3 (D, H, W)"], id="four-dims"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: 4, k: 4, f: 5, pad: 0}\n",
                 ["layer 1 (a)", "field 'f'", "output would be empty"], id="filter-too-large"),
    pytest.param("name: x\nbatch: 2\nlayers:\n"
                 "  - {name: a, c: 4, in: 4, k: 4, f: 1, directions: [fwd, fwd]}\n",
                 ["layer 1 (a)", "field 'directions'", "twice"], id="direction-twice"),
    pytest.param("name: x\nbatch: 2\nlayers:\n"
                 "  - {name: a, c: 4, in: 4, k: 4, f: 1, directions: [forward]}\n",
                 ["layer 1 (a)", "field 'directions'", "fwd, bwd_data, bwd_filter"],
                 id="unknown-direction"),
    pytest.param("name: x\nbatch: 2\nlayers:\n  - {name: a, c: 4, in: 4, k: 4, f: 1, count: 1.5}\n",
                 ["layer 1 (a)", "field 'count'", "number 1.5"], id="fractional-count"),
])
def test_bad_config(tmp_path, text, fragments):
    check_error(write_config(tmp_path, text), *fragments)


def test_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    check_error(path, "not UTF-8")
