//! docker/ (the image for GPU CI runners) without a container engine: docker/Dockerfile read
//! with a small instruction parser (comments dropped, `\` continuation lines joined, flags such
//! as `--from=build` split off, global `ARG` defaults substituted), checked against the repository
//! it builds from — the stages and base images, the install steps (scripts/install-deps.sh, as
//! .ci/run), the entrypoint, the version labels against the pins in scripts/ and Cargo.toml, and
//! the build context; and the CI examples in docker/ci/ read as YAML (the serde_yaml_ng crate).

use std::collections::BTreeMap;
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// One instruction of a Dockerfile.
#[derive(Debug)]
struct Instr {
    /// 0: before the first FROM (global ARGs); n: the n-th stage.
    stage: usize,
    /// The keyword, upper case (`RUN`, `COPY`, ...).
    cmd: String,
    /// Leading `--name=value` flags (`--from=build`).
    flags: Vec<String>,
    /// The rest, continuation lines joined by a space.
    args: String,
}

/// Parses a Dockerfile as BuildKit's parser does for what these tests need: lines whose first
/// non-blank character is `#` are comments (also inside a continued instruction), a line ending
/// in `\` continues on the next.
fn parse(text: &str) -> Vec<Instr> {
    let mut out = Vec::new();
    let mut stage = 0;
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && pending.is_empty()) {
            continue;
        }
        let (body, more) = match t.strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (t, false),
        };
        if !pending.is_empty() {
            pending.push(' ');
        }
        pending.push_str(body);
        if more {
            continue;
        }
        let full = std::mem::take(&mut pending);
        let (cmd, mut rest) = full.split_once(char::is_whitespace).unwrap_or((&full, ""));
        let cmd = cmd.to_ascii_uppercase();
        let mut flags = Vec::new();
        loop {
            rest = rest.trim_start();
            if !rest.starts_with("--") {
                break;
            }
            let (f, r) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            flags.push(f.to_string());
            rest = r;
        }
        if cmd == "FROM" {
            stage += 1;
        }
        out.push(Instr { stage, cmd, flags, args: rest.trim().to_string() });
    }
    assert!(pending.is_empty(), "the Dockerfile ends inside a continued instruction");
    out
}

fn dockerfile() -> Vec<Instr> {
    parse(&read("docker/Dockerfile"))
}

/// The global `ARG NAME=default` values (before the first FROM).
fn global_args(ins: &[Instr]) -> BTreeMap<String, String> {
    ins.iter()
        .filter(|i| i.stage == 0 && i.cmd == "ARG")
        .filter_map(|i| i.args.split_once('=').map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string())))
        .collect()
}

/// `s` with every `${NAME}` replaced from `vars`; panics on a name `vars` lacks.
fn subst(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find('}').expect("unclosed ${") + i;
        let name = &rest[i + 2..end];
        out.push_str(vars.get(name).unwrap_or_else(|| panic!("${{{name}}} has no default")));
        rest = &rest[end + 1..];
    }
    out + rest
}

/// Splits `s` at blanks outside double quotes, dropping the quotes.
fn words(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// The stages: (index, image with the global ARG defaults substituted, `AS` name).
fn stages(ins: &[Instr]) -> Vec<(usize, String, String)> {
    let args = global_args(ins);
    ins.iter()
        .filter(|i| i.cmd == "FROM")
        .map(|i| {
            let w = words(&i.args);
            assert!(w.len() == 3 && w[1].eq_ignore_ascii_case("as"), "FROM without a stage name: {}", i.args);
            (i.stage, subst(&w[0], &args), w[2].clone())
        })
        .collect()
}

#[test]
fn the_image_builds_in_a_rust_stage_and_runs_on_the_cuda_13_runtime_image() {
    let ins = dockerfile();
    let st = stages(&ins);
    assert_eq!(st.len(), 2, "a build stage and a runtime stage: {st:?}");
    let (build, runtime) = (&st[0], &st[1]);
    assert!(build.1.starts_with("rust:"), "the build stage is not on the Rust image: {build:?}");
    assert_eq!(build.2, "build");
    // nvidia/cuda:<13.x.y>-runtime-<os>: CUDA 13, the runtime flavour (cudart and NVRTC).
    let tag = runtime.1.strip_prefix("nvidia/cuda:").unwrap_or_else(|| panic!("runtime base: {}", runtime.1));
    let (version, flavour) = tag.split_once('-').unwrap();
    assert!(version.starts_with("13."), "not CUDA 13: {}", runtime.1);
    assert!(flavour.starts_with("runtime-"), "not a runtime image: {}", runtime.1);
    assert_eq!(runtime.2, "runtime");

    let last: Vec<&Instr> = ins.iter().filter(|i| i.stage == runtime.0).collect();
    let entry: Vec<&&Instr> = last.iter().filter(|i| i.cmd == "ENTRYPOINT").collect();
    assert_eq!(entry.len(), 1, "one ENTRYPOINT in the runtime stage");
    assert_eq!(entry[0].args, r#"["kvprobe"]"#, "exec form, so `docker run IMAGE run ...` runs `kvprobe run ...`");
    // The binary comes from the build stage onto PATH.
    assert!(
        last.iter().any(|i| i.cmd == "COPY"
            && i.flags.contains(&"--from=build".to_string())
            && i.args.ends_with(" /usr/local/bin/kvprobe")),
        "no COPY --from=build of kvprobe into /usr/local/bin"
    );
    // kvprobe finds NIXL and Mooncake under KVPROBE_HOME: set, absolute, before the install.
    let home = last.iter().position(|i| i.cmd == "ENV" && i.args.starts_with("KVPROBE_HOME=/")).expect("ENV KVPROBE_HOME=/...");
    let install = last.iter().position(|i| i.cmd == "RUN" && i.args.contains("install-deps.sh --runtime")).unwrap();
    assert!(home < install, "KVPROBE_HOME is set after the install: the install went elsewhere");
    // The CI examples mount their output directory on the working directory.
    assert!(last.iter().any(|i| i.cmd == "WORKDIR" && i.args == "/work"));
}

#[test]
fn every_dependency_install_in_the_image_is_install_deps_sh_as_in_ci() {
    assert!(read(".ci/run").contains("scripts/install-deps.sh"), ".ci/run no longer runs scripts/install-deps.sh");
    let ins = dockerfile();
    // Installing by any other route would let the image drift from CI.
    let direct =
        ["apt-get install", "apt install", "pip install", "pip download", "dpkg -i", "curl ", "wget ", "install-mooncake.sh"];
    let mut seen = Vec::new();
    for i in ins.iter().filter(|i| i.cmd == "RUN") {
        for d in direct {
            assert!(!i.args.contains(d), "a RUN installs with `{d}` instead of scripts/install-deps.sh: {}", i.args);
        }
        if let Some(p) = i.args.find("scripts/install-deps.sh") {
            let part = i.args[p..].split_whitespace().nth(1).unwrap_or("");
            seen.push((i.stage, part.to_string()));
        }
    }
    let st = stages(&ins);
    assert!(seen.contains(&(st[0].0, "--build".to_string())), "the build stage does not run install-deps.sh --build: {seen:?}");
    assert!(
        seen.contains(&(st[1].0, "--runtime".to_string())),
        "the runtime stage does not run install-deps.sh --runtime: {seen:?}"
    );
    // The build stage installs before it builds.
    let first = |pred: &dyn Fn(&Instr) -> bool| ins.iter().position(|i| i.stage == st[0].0 && pred(i)).unwrap();
    assert!(
        first(&|i| i.cmd == "RUN" && i.args.contains("install-deps.sh"))
            < first(&|i| i.cmd == "RUN" && i.args.contains("cargo build"))
    );
}

/// `NAME="value"` of a shell assignment in `text`.
fn shell_value(text: &str, name: &str) -> String {
    let line = text.lines().find(|l| l.starts_with(&format!("{name}="))).unwrap_or_else(|| panic!("no {name}="));
    line[name.len() + 1..].trim_matches('"').to_string()
}

/// The version a pin `wheel==VERSION` names in `text` (up to a quote, brace or blank).
fn pin(text: &str, wheel: &str) -> String {
    let at = text.find(&format!("{wheel}==")).unwrap_or_else(|| panic!("no pin of {wheel}")) + wheel.len() + 2;
    text[at..].chars().take_while(|c| !matches!(c, '"' | '}' | ' ' | '\n')).collect()
}

#[test]
fn the_image_labels_carry_the_versions_pinned_in_the_repository() {
    let ins = dockerfile();
    let st = stages(&ins);
    let runtime: Vec<&Instr> = ins.iter().filter(|i| i.stage == st[1].0).collect();
    // A global ARG is empty inside a stage unless the stage declares it again.
    let declared: Vec<&str> = runtime.iter().filter(|i| i.cmd == "ARG").map(|i| i.args.split('=').next().unwrap()).collect();
    let mut labels = BTreeMap::new();
    for i in runtime.iter().filter(|i| i.cmd == "LABEL") {
        for w in words(&i.args) {
            let (k, v) = w.split_once('=').unwrap_or_else(|| panic!("LABEL word without '=': {w}"));
            for name in v.split("${").skip(1).map(|s| s.split('}').next().unwrap()) {
                assert!(declared.contains(&name), "label {k} uses ${{{name}}}, not declared in the runtime stage");
            }
            labels.insert(k.to_string(), subst(v, &global_args(&ins)));
        }
    }
    let label = |k: &str| labels.get(k).cloned().unwrap_or_else(|| panic!("no label {k}: {labels:?}"));

    let deps = read("scripts/install-deps.sh");
    let nixl = format!("{} {}", shell_value(&deps, "NIXL_WHEEL"), shell_value(&deps, "NIXL_VERSION"));
    assert_eq!(label("io.kvprobe.nixl"), nixl);
    let mooncake = read("scripts/install-mooncake.sh");
    let wheel = "mooncake-transfer-engine-cuda13"; // what install-mooncake.sh picks on CUDA 13
    assert_eq!(label("io.kvprobe.mooncake"), format!("{wheel} {}", pin(&mooncake, wheel)));

    let cargo = read("Cargo.toml");
    let sys = cargo.lines().find(|l| l.starts_with("nixl-sys ")).expect("nixl-sys in Cargo.toml");
    let sys = sys.split("version = \"").nth(1).unwrap().split('"').next().unwrap().trim_start_matches('=');
    assert_eq!(label("io.kvprobe.nixl-sys"), sys);
    let version = cargo.lines().find_map(|l| l.strip_prefix("version = \"")).unwrap().trim_end_matches('"');
    assert_eq!(label("org.opencontainers.image.version"), version, "the package version in Cargo.toml");
    assert!(st[1].1.contains(&format!(":{}-", label("io.kvprobe.cuda"))), "CUDA label vs base image {}", st[1].1);
    assert!(st[0].1.contains(&format!(":{}-", label("io.kvprobe.rust"))), "Rust label vs base image {}", st[0].1);
}

#[test]
fn every_copy_source_is_in_the_build_context() {
    let ins = dockerfile();
    let ignored: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_matches('/').to_string())
        .collect();
    for must in ["target", ".carry", ".git"] {
        assert!(ignored.iter().any(|i| i == must), ".dockerignore does not leave out {must}");
    }
    let mut copied = Vec::new();
    for i in ins.iter().filter(|i| (i.cmd == "COPY" || i.cmd == "ADD") && !i.flags.iter().any(|f| f.starts_with("--from="))) {
        let w = words(&i.args);
        assert!(w.len() >= 2, "{}", i.args);
        for src in &w[..w.len() - 1] {
            assert!(repo().join(src).exists(), "COPY source {src} is not in the repository");
            let top = src.trim_matches('/').split('/').next().unwrap().to_string();
            assert!(!ignored.contains(&top), "COPY source {src} is left out by .dockerignore");
            copied.push(top);
        }
    }
    // What the build reads: the manifest, build.rs's C sources, and every file src/ embeds
    // (include_str!: csrc/ kernels, the fingerprint reference and the Mooncake worker in pysrc/).
    for need in ["Cargo.toml", "Cargo.lock", "build.rs", "src", "csrc", "pysrc", "scripts", "tests"] {
        assert!(copied.iter().any(|c| c == need), "the image never copies {need}");
    }
    // Every file of src/, at any depth: an include_str! path climbs out of src/ and names a
    // folder at the top of the repository.
    let mut todo = vec![repo().join("src")];
    let mut embeds = 0;
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for part in text.split("include_str!(\"").skip(1) {
                let rel = &part[..part.find('"').unwrap()];
                let at = path.parent().unwrap().join(rel);
                let inside = at.canonicalize().unwrap_or_else(|e| panic!("{}: include_str!({rel}): {e}", path.display()));
                let top = inside.strip_prefix(repo().canonicalize().unwrap()).unwrap().components().next().unwrap();
                let top = top.as_os_str().to_string_lossy().to_string();
                assert!(copied.contains(&top), "src/ embeds {top}/..., which the image does not copy");
                embeds += 1;
            }
        }
    }
    assert!(embeds >= 4, "{embeds} include_str! found in src/");
}

/// A YAML file as JSON, read with the serde_yaml_ng crate (no python needed: GPU lanes fail
/// on any SKIP). Always `Some`.
fn yaml(_test: &str, rel: &str) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(repo().join(rel)).unwrap();
    Some(serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}")))
}

/// Checks the shell lines of a CI job: the image is built from docker/Dockerfile, run with the
/// docs/container.md's flags on the output directory, and `env`, `run` and `ab` run with the JUnit and
/// bundle paths the artifacts keep.
fn assert_job_commands(ci: &str, lines: &str) {
    assert!(lines.contains("docker build -f docker/Dockerfile "), "{ci}: does not build docker/Dockerfile");
    for flag in ["--gpus all", "--ipc=host", "--network=host", "--ulimit memlock=-1", ":/work", "-w /work"] {
        assert!(lines.contains(flag), "{ci}: the run flags lack {flag}");
    }
    let cmd = |sub: &str| {
        lines.lines().find(|l| l.contains(&format!("\"$IMAGE\" {sub}"))).unwrap_or_else(|| panic!("{ci}: no kvprobe {sub}"))
    };
    cmd("env");
    let run = cmd("run ");
    assert!(run.contains("--junit junit-run.xml") && run.contains("--bundle run.tar.gz"), "{ci}: {run}");
    let ab = cmd("ab ");
    assert!(ab.contains("--junit junit-ab.xml"), "{ci}: {ab}");
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    match v {
        serde_json::Value::String(s) => s.lines().map(|l| l.trim().to_string()).collect(),
        serde_json::Value::Array(a) => a.iter().flat_map(strings).collect(),
        _ => Vec::new(),
    }
}

#[test]
fn the_ci_examples_run_env_run_and_ab_and_keep_the_junit_and_the_bundle() {
    let test = "the_ci_examples_run_env_run_and_ab_and_keep_the_junit_and_the_bundle";
    let keep = ["out/junit-run.xml", "out/junit-ab.xml", "out/run.tar.gz"];

    let Some(gh) = yaml(test, "docker/ci/github-actions.yml") else { return };
    let job = &gh["jobs"]["kvprobe"];
    let runs_on = strings(&job["runs-on"]);
    assert!(runs_on.contains(&"self-hosted".into()) && runs_on.contains(&"gpu".into()), "runs-on: {runs_on:?}");
    let steps = job["steps"].as_array().expect("steps");
    let lines: Vec<String> = steps.iter().flat_map(|s| strings(&s["run"])).collect();
    assert_job_commands("github-actions.yml", &lines.join("\n"));
    let upload = steps
        .iter()
        .find(|s| s["uses"].as_str().is_some_and(|u| u.starts_with("actions/upload-artifact@")))
        .expect("no actions/upload-artifact step");
    assert!(upload["if"].as_str().is_some_and(|c| c.contains("always()")), "artifacts not kept when a step fails");
    let paths = strings(&upload["with"]["path"]);
    for k in keep {
        assert!(paths.contains(&k.to_string()), "github-actions.yml does not keep {k}: {paths:?}");
    }

    let Some(gl) = yaml(test, "docker/ci/gitlab-ci.yml") else { return };
    let job = &gl["kvprobe"];
    assert!(strings(&job["tags"]).contains(&"gpu".into()));
    assert_job_commands("gitlab-ci.yml", &strings(&job["script"]).join("\n"));
    let art = &job["artifacts"];
    assert_eq!(art["when"], "always", "artifacts not kept when the job fails");
    let junit = strings(&art["reports"]["junit"]);
    let paths = strings(&art["paths"]);
    for k in keep {
        assert!(junit.contains(&k.to_string()) || paths.contains(&k.to_string()), "gitlab-ci.yml does not keep {k}");
    }
    assert!(junit.contains(&keep[0].into()) && junit.contains(&keep[1].into()), "JUnit not reported: {junit:?}");
}

#[test]
fn the_container_page_gives_the_build_command_and_each_run_flag() {
    let section = read("docs/container.md");
    for s in [
        "docker build -f docker/Dockerfile -t kvprobe .",
        "--gpus all",
        "--ipc=host",
        "--network=host",
        "--ulimit memlock=-1",
        "--device /dev/infiniband",
        "--cap-add IPC_LOCK",
        "docker/ci/github-actions.yml",
        "docker/ci/gitlab-ci.yml",
    ] {
        assert!(section.contains(s), "docs/container.md lacks `{s}`");
    }
}
