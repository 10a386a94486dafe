"""The package's top level: its names resolve, and importing it (or asking the CLI for help, or running the load
generator) loads no PyTorch."""

import subprocess
import sys


def test_importing_the_package_loads_no_torch_until_a_name_needs_it():
    code = (
        "import sys, fiberserve\n"
        "assert 'torch' not in sys.modules, 'import fiberserve loaded torch'\n"
        "from fiberserve.cli import main\n"
        "assert 'torch' not in sys.modules, 'the CLI module loaded torch'\n"
        "import fiberserve.bench.cli, fiberserve.model\n"
        "from fiberserve.model.config import read_config\n"
        "assert 'torch' not in sys.modules, 'the load generator (or reading a config) loaded torch'\n"
        "from fiberserve import kernels\n"
        "from fiberserve.model import LlamaModel\n"
        "assert LlamaModel.__module__ == 'fiberserve.model.llama' and kernels.__name__ == 'fiberserve.kernels'\n"
        "from fiberserve import LLM, EngineConfig, SamplingParams\n"
        "assert 'torch' in sys.modules and LLM.__module__ == 'fiberserve.offline'\n"
        "assert sorted(fiberserve.model.__all__) == sorted(fiberserve.model._HOMES)\n"
        "assert all(getattr(fiberserve.model, name).__name__ == name for name in fiberserve.model.__all__)\n"
        "assert SamplingParams(max_new_tokens=3).max_new_tokens == 3 and EngineConfig().fibers > 0\n"
        "for package in (fiberserve, fiberserve.model):\n"
        "    try:\n"
        "        package.no_such_name\n"
        "    except AttributeError as exc:\n"
        "        assert 'no_such_name' in str(exc)\n"
        "    else:\n"
        "        raise AssertionError('an unknown name resolved')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    help_text = subprocess.run([sys.executable, "-m", "fiberserve.cli", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "serve" in help_text.stdout, help_text.stderr
