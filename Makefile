# Quick start: `make demo` and `make test`. Everything below delegates to CMake + scripts/.
BUILD ?= build
JOBS  ?= $(shell nproc)

.PHONY: all setup build test demo clean
all: build

setup:
	scripts/setup.sh

build: setup
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)
	scripts/models.sh

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1800

demo: build
	scripts/demo.sh

clean:
	rm -rf $(BUILD)/CMakeFiles $(BUILD)/src $(BUILD)/tests $(BUILD)/pdbridge
