"""Packaging for tf-psx: parameter-server training for huge sparse embedding tables."""

from setuptools import find_packages, setup

# Ranges, not pins: tf_psx runs on the TensorFlow its users have. The upper
# bound is the newest minor tested here (DESIGN.md and the README's install
# section say which versions are tested). tf-keras follows TensorFlow's minor
# (Keras 3 cannot fit under ParameterServerStrategy).
INSTALL_REQUIRES = [
    "tensorflow>=2.16.2,<2.22",
    "tf-keras>=2.16,<2.22",
    "numpy>=1.26",
    "pyyaml>=6",
    # The Prometheus endpoint (tf_psx.metrics) and the task memory and CPU it reports.
    "prometheus-client>=0.20",
    "psutil>=5.9",
]

EXTRAS_REQUIRE = {
    # TFRA's own layers and optimizers in user code. TFRA 0.8.1 (its last release) has wheels only for
    # TensorFlow 2.16.2 and Python 3.9-3.11, so this extra means that stack (`make install-tfra`).
    "tfra": [
        "tensorflow==2.16.2",
        "tf-keras>=2.16,<2.17",
        "tensorflow-recommenders-addons==0.8.1; python_version < '3.12'",
        "numpy<2",
        # TFRA 0.8.1 imports pkg_resources, which setuptools 80+ no longer ships.
        "setuptools<80",
    ],
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
        "tensorboard>=2.16,<2.22",
        # TensorFlow Recommenders, whose tutorial models the tests train under the strategy (both stacks).
        "tensorflow-recommenders>=0.7.3",
        # DeepCTR's models (FiBiNET, DeepFM) in the memory benchmark and its test: pure Python, tf.keras.
        "deepctr==0.9.4",
    ],
}

setup(
    name="tf-psx",
    version="0.2.0",
    description="Parameter-server training for TensorFlow models with huge sparse embedding tables.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_psx", "tf_psx.*"]),
    # TensorFlow 2.16-2.21 cover Python 3.9-3.13 between them; tested here: 3.11 only (README, "Install").
    python_requires=">=3.10,<3.14",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["tf-psx=tf_psx.cli:main"]},
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ],
)
