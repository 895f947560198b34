# Sourced by the GPU benchmark scripts: with .whl/ carried (../shared/gpu-host/wheels.sh), install
# our small dependencies into /tmp/site, put them and the tree on PYTHONPATH, and make `import
# meshrl` resolve to this tree (an editable install that resolves nothing). Without .whl/, nothing.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
fi
