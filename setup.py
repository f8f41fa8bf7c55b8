"""Packaging for tf-psx: parameter-server training for huge sparse embedding tables."""

from setuptools import find_packages, setup

# The stack is pinned; DESIGN.md gives the measured reason for each pin.
INSTALL_REQUIRES = [
    "tensorflow==2.16.2",
    "tf-keras>=2.16,<2.17",
    "tensorflow-recommenders-addons==0.8.1",
    "numpy<2",
    "pyyaml>=6",
    # TFRA 0.8.1 imports pkg_resources, which setuptools 80+ no longer ships.
    "setuptools<80",
    # The Prometheus endpoint (tf_psx.metrics) and the task memory and CPU it reports.
    "prometheus-client>=0.20",
    "psutil>=5.9",
]

EXTRAS_REQUIRE = {
    "dev": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "pytest-xdist>=3.5",
        "nbclient>=0.9",
        "nbformat>=5.9",
        "ipykernel>=6.25",
        "matplotlib>=3.7",
        "mkdocs>=1.5",
        "mkdocstrings[python]>=0.24",
        "jsonschema>=4",
        "tensorboard>=2.16,<2.17",
    ],
}

setup(
    name="tf-psx",
    version="0.1.0",
    description="Parameter-server training for TensorFlow models with huge sparse embedding tables.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_psx", "tf_psx.*"]),
    python_requires=">=3.11,<3.12",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["tf-psx=tf_psx.cli:main"]},
    license="Apache-2.0",
)
