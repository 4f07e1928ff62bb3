"""Installs moecomm_engine_alias.py and, next to it in site-packages, moecomm_engine_alias.pth
(the one line that runs at every interpreter start). Metadata is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "moecomm_engine_alias.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """Puts the .pth at the root of the wheel (site-packages), where `site` reads it."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        mapping = dict(super().get_output_mapping())
        mapping[os.path.join(self.build_lib, PTH)] = os.path.join(HERE, PTH)
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
