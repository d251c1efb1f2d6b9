"""Builds libdbr_agent.so as part of any install (`pip install .` needs no manual step)."""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithAgent(build_py):
    """Compile the agent with its own Makefile, then copy it into the build tree."""

    def run(self):
        super().run()
        if not self.editable_mode:  # editable installs: `make build` compiles it in place
            subprocess.check_call(["make", "-C", os.path.join(HERE, "dbr_agent")])
            dest = os.path.join(self.build_lib, "dbr_agent")
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(os.path.join(HERE, "dbr_agent", "libdbr_agent.so"), dest)
            shutil.copy2(os.path.join(HERE, "shared", "dbr_protocol.h"), dest)


setup(cmdclass={"build_py": BuildWithAgent})
