//! Compiles the C shim of the JPEG decoder over libjpeg-turbo's libjpeg API
//! (see `src/libjpeg.rs`), linked against the system's libjpeg-turbo
//! (Debian: `libjpeg62-turbo-dev`).

fn main() {
    println!("cargo::rerun-if-changed=csrc/jpeg_turbo.c");
    // libjpeg-turbo 1.5 added jpeg_crop_scanline / jpeg_skip_scanlines; IJG's
    // libjpeg (versions 6b–9f, same pkg-config name) has neither.
    let jpeg = match pkg_config::Config::new().range_version("1.5".."5").cargo_metadata(false).probe("libjpeg") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "\n\nstoker decodes JPEG with libjpeg-turbo (1.5 or newer), which pkg-config did not find:\n  {e}\n\
             Install it: `apt-get install libjpeg62-turbo-dev pkg-config` on Debian \
             (`libjpeg-turbo8-dev` on Ubuntu, `libjpeg-turbo-devel` on Fedora), or run scripts/setup.sh.\n\n"
        ),
    };
    let mut build = cc::Build::new();
    build.file("csrc/jpeg_turbo.c").flag_if_supported("-Wall").flag_if_supported("-Wextra");
    for dir in &jpeg.include_paths {
        build.include(dir);
    }
    build.compile("stoker_jpeg_turbo");
    // After the static shim, so the linker resolves the shim's references.
    for dir in &jpeg.link_paths {
        println!("cargo::rustc-link-search=native={}", dir.display());
    }
    for lib in &jpeg.libs {
        println!("cargo::rustc-link-lib={lib}");
    }
}
