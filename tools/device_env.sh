# Source from the repository root on the lent GPU machine (device tool): makes `import glm53`
# resolve without an install. There the repository's own glm53/ folder shadows an editable
# install (the image's setuptools maps package-dir leniently), so link the four packages into it.
for d in kernels models server transport; do ln -sfn "../$d" "glm53/$d"; done
export PYTHONUNBUFFERED=1
