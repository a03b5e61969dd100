import os
from types import SimpleNamespace

import pytest
import torch

import towerflow
from towerflow import Config, ConfigError
from towerflow.devices import gpu_memory


def test_defaults_change_nothing_in_pytorch():
    config = towerflow.configure()
    assert config.log_device_placement is False
    assert config.allow_soft_placement is False
    assert config.allow_growth is True
    assert config.default_device is None


def test_configure_updates_only_what_it_names():
    towerflow.configure(allow_soft_placement=True)
    config = towerflow.configure(log_device_placement="summary")
    assert config.allow_soft_placement is True
    assert config.log_device_placement == "summary"


def test_tf_config_proto_spellings_carry_over():
    config = Config(log_device_placement=True, allow_soft_placement=True)
    config.gpu_options.allow_growth = False
    config.gpu_options.per_process_gpu_memory_fraction = 0.4
    config.gpu_options.visible_device_list = "0,1"
    assert config.allow_growth is False
    assert config.gpu_memory_fraction == 0.4
    assert config.visible_devices == [0, 1]
    assert config.gpu_options.per_process_gpu_memory_fraction == 0.4
    assert Config(gpu_options={"allow_growth": True}).allow_growth is True


def test_device_count_makes_logical_cpus_and_hides_gpus():
    config = Config(device_count={"CPU": 4, "GPU": 0})
    assert config.logical_devices == {"CPU:0": [None] * 4}
    assert config.visible_devices == []


@pytest.mark.parametrize(
    "options,fragment",
    [
        ({"allow_grouth": True}, "did you mean 'allow_growth'"),
        ({"allow_soft_placement": "yes"}, "expected True or False"),
        ({"gpu_memory_fraction": 1.5}, "fraction in (0, 1]"),
        ({"gpu_memory_fraction": 0}, "fraction in (0, 1]"),
        ({"memory_limit": -5}, "positive int"),
        ({"memory_limit": {"a": 5}}, "GPU index"),
        ({"visible_devices": [0, 0]}, "distinct"),
        ({"visible_devices": "0,x"}, "comma-separated"),
        ({"logical_devices": {"CPU": 0}}, "count >= 1"),
        ({"logical_devices": {"TPU:0": 2}}, "physical 'CPU' or 'GPU:<n>'"),
        ({"logical_devices": ["CPU"]}, "expected a dict"),
        ({"log_device_placement": "all"}, "'summary'"),
        ({"log_filter": {"layer": "x"}}, "expected 'op', 'module' or 'device'"),
        ({"log_filter": {"op": "("}}, "not a regular expression"),
        ({"device_count": {"TPU": 1}}, "expected 'CPU' or 'GPU'"),
        ({"default_device": "/gpo:0"}, "did you mean 'gpu'"),
    ],
)
def test_bad_values_get_clear_errors(options, fragment):
    with pytest.raises(ValueError) as info:
        Config(**options)
    assert fragment.lower() in str(info.value).lower()


def test_gpu_options_typo_is_refused():
    config = Config()
    with pytest.raises(ConfigError, match="allow_growth"):
        config.gpu_options.alow_growth = True


def test_invalid_configure_changes_nothing():
    towerflow.configure(allow_soft_placement=True)
    with pytest.raises(ConfigError):
        towerflow.configure(allow_soft_placement=False, gpu_memory_fraction=3)
    assert towerflow.configure().allow_soft_placement is True


def test_logical_gpu_split_of_an_absent_gpu_is_refused_with_the_devices_that_exist():
    with pytest.raises(ConfigError, match="GPU:3.*physical devices: CPU:0"):
        towerflow.configure(logical_devices={"GPU:3": 2})


def test_visible_devices_sets_cuda_visible_devices_relative_to_the_launch_value(monkeypatch):
    monkeypatch.setattr(gpu_memory, "_original_env", "4,5,6")
    monkeypatch.setattr(gpu_memory, "_cuda_started", lambda: False)  # on a GPU machine an earlier test may have
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    towerflow.configure(visible_devices=[2, 0])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,4"
    with pytest.raises(ConfigError, match="has 3 GPU"):
        towerflow.configure(visible_devices=[3])
    towerflow.configure(visible_devices=None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"


def test_visible_devices_after_cuda_started_is_an_error_not_ignored(monkeypatch):
    monkeypatch.setattr(gpu_memory, "_cuda_started", lambda: True)
    with pytest.raises(ConfigError, match="CUDA runtime already started"):
        towerflow.configure(visible_devices=[1])
    assert towerflow.configure().visible_devices is None


def test_memory_cap_takes_the_tightest_option():
    total = 16 << 30
    config = Config(gpu_memory_fraction=0.5, memory_limit={0: 4096})
    assert gpu_memory._memory_cap(config, 0, total) == 4096 << 20
    assert gpu_memory._memory_cap(config, 1, total) == total // 2
    split = Config(logical_devices={"GPU:0": [1024, 1024]})
    assert gpu_memory._memory_cap(split, 0, total) == 2048 << 20
    assert gpu_memory._memory_cap(Config(), 0, total) is None


def test_a_replica_on_one_logical_gpu_is_capped_at_that_device_s_limit(monkeypatch):
    from towerflow.devices.logical import _split
    from towerflow.devices.physical import PhysicalDevice

    card = PhysicalDevice("GPU", 0, "cuda:0", "a GPU of 80 GiB", memory_bytes=80 << 30)
    small, large = _split([card], {"GPU:0": [2048, 6144]})
    fractions = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: fractions.update({index: f}))
    assert gpu_memory.confine_to(large) == 6144 << 20 and fractions == {0: (6144 << 20) / (80 << 30)}
    assert gpu_memory.confine_to(small) == 2048 << 20 and fractions == {0: (2048 << 20) / (80 << 30)}
    whole = _split([card], {})[0]
    fractions.clear()
    assert gpu_memory.confine_to(whole) is None and not fractions  # an unsplit GPU: the process's own options rule
    towerflow.configure(gpu_memory_fraction=0.05)  # 4 GiB of the card: tighter than the logical device's 6 GiB
    assert gpu_memory.confine_to(large) == int(0.05 * (80 << 30))


def test_gpu_memory_options_on_a_cpu_machine_are_accepted(caplog):
    # The same script must run on a laptop: GPU options apply to no device there.
    config = towerflow.configure(gpu_memory_fraction=0.4, allow_growth=False)
    assert config.gpu_memory_fraction == 0.4


def test_config_repr_shows_what_differs_from_defaults():
    assert repr(Config(allow_soft_placement=True)) == "Config(allow_soft_placement=True)"
