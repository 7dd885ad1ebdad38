fn main() {
    let _ = include_bytes!(concat!(env!("OUT_DIR"), "/gate"));
}
