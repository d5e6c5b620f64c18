"""Installs ``zerodp-as-deepspeed.pth`` beside the package, in regular and editable installs.

The ``.pth`` line reads ``ZERODP_AS_DEEPSPEED`` at interpreter start-up and does nothing else
when it is unset (see ``src/zerodp_as_deepspeed.py``). Everything else is in pyproject.toml.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "zerodp-as-deepspeed.pth"
PTH_SOURCE = os.path.join("src", PTH)


class BuildWithPth(build_py):
    """A regular build: the .pth goes to the top of the wheel (site-packages)."""

    def run(self):
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildWithPth}

try:  # an editable install builds its own wheel: add the .pth to it
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _AddPth(super()._select_strategy(*args, **kwargs))

    class _AddPth:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, wheel, files, mapping):
            self.inner(wheel, files, mapping)
            with open(PTH_SOURCE, "rb") as f:
                wheel.writestr(PTH, f.read())

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    cmdclass["editable_wheel"] = EditableWithPth
except ImportError:  # an older setuptools: editable installs go without the switch
    pass

setup(cmdclass=cmdclass)
